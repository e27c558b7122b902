// The Chrome-trace timeline: spans from several threads land in one file, one track per
// thread, with their names, categories and durations; writing clears them; the reducer
// records its bucket all-reduces.
#include "gradsync/timeline.h"

#include <gtest/gtest.h>

#include <thread>

#include "gradsync/reducer.h"
#include "harness.h"

namespace gradsync {
namespace {

using testing::contains;

TEST(Timeline, SpansFromEveryThreadAreWrittenAsChromeTraceEvents) {
  timeline::enable();
  const std::string path = testing::build_dir() + "/timeline_test.json";
  testing::run_inproc_contexts(1, [&](Context& ctx) {
    { timeline::Span s("forward", "compute"); }
    std::thread other([] { timeline::Span s("allreduce \"bucket\" 0", "comm"); });
    other.join();
    timeline::record("optimizer", "optimizer", 100, 350);
    EXPECT_EQ(timeline::write(ctx, path), 3u);
    EXPECT_EQ(timeline::write(ctx, path), 0u);  // cleared: only the rank's name remains
  });
  testing::run_inproc_contexts(1, [&](Context& ctx) {
    { timeline::Span s("forward", "compute"); }
    EXPECT_EQ(timeline::write(ctx, path), 1u);
  });
  // The last write: one span and the process name.
  const std::string text = testing::read_file(path);
  EXPECT_TRUE(contains(text, "{\"traceEvents\":[")) << text;
  EXPECT_TRUE(contains(text, "\"name\":\"forward\",\"cat\":\"compute\",\"ph\":\"X\"")) << text;
  EXPECT_TRUE(contains(text, "\"args\":{\"name\":\"rank 0\"}")) << text;
}

TEST(Timeline, TheReducerRecordsItsBuckets) {
  timeline::enable();
  const std::string path = testing::build_dir() + "/timeline_reducer.json";
  testing::run_inproc_contexts(1, [&](Context& ctx) {
    timeline::write(ctx, path);  // start empty
    ReducerOptions o;
    o.codec = "fp16";
    Reducer reducer(ctx, o);
    // Two gradients with a gap between them: no bucket can view them in place, so both are
    // packed into bucket memory.
    std::vector<float> g(2001, 1.0f);
    const int w = reducer.add_parameter("w", 500, std::span<float>(g).subspan(0, 500));
    const int v = reducer.add_parameter("v", 500, std::span<float>(g).subspan(1001, 500));
    reducer.mark_ready(v);
    reducer.mark_ready(w);
    reducer.finish();
    EXPECT_GE(timeline::write(ctx, path), 3u);  // pack, the bucket's all-reduce, wait, unpack
  });
  const std::string text = testing::read_file(path);
  EXPECT_TRUE(contains(text, "\"name\":\"allreduce bucket 0 (3 KiB, fp16)\",\"cat\":\"comm\""))
      << text;
  EXPECT_TRUE(contains(text, "\"name\":\"pack w\"")) << text;
}

}  // namespace
}  // namespace gradsync
