// The timeline of a real multi-process run: gradsync-train on 3 ranks under gradsync-run
// with GRADSYNC_TIMELINE set writes one Chrome-trace file (valid JSON, one row per rank, the
// model's per-layer spans, the reducer's bucket all-reduces, the optimizer), with every
// rank's spans on the host's one clock; without GRADSYNC_TIMELINE nothing is written. The
// in-process unit tests (timeline_test) cannot see a rank's pid or the clock across processes.
#include <gtest/gtest.h>

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "harness.h"

namespace gradsync {
namespace {

using testing::contains;

constexpr int kRanks = 3;
constexpr int kSteps = 3;

// A JSON value, with just enough of a parser to tell the trace is well-formed JSON (a
// library would be a new dependency for one test).
struct Json {
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  Kind kind = Kind::kNull;
  std::string text;  // a string's value, or a number as written
  std::vector<Json> items;
  // An object's members, as two vectors: a std::pair of an incomplete Json is refused by
  // clang with libstdc++, a std::vector of one is allowed.
  std::vector<std::string> keys;
  std::vector<Json> values;

  const Json* find(const std::string& key) const {
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] == key) return &values[i];
    }
    return nullptr;
  }
};

// Strict RFC 8259 grammar (no trailing commas, no raw control characters in strings, nothing
// after the value but whitespace): the trace viewers reject what a lenient parser accepts.
class JsonParser {
 public:
  explicit JsonParser(const std::string& s) : s_(s) {}

  Json parse() {
    Json v = value();
    skip_space();
    if (at_ != s_.size()) fail("text after the top-level value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error(what + " at offset " + std::to_string(at_) + ": '" +
                             s_.substr(at_, 40) + "'");
  }
  void skip_space() {
    while (at_ < s_.size() &&
           (s_[at_] == ' ' || s_[at_] == '\n' || s_[at_] == '\r' || s_[at_] == '\t')) {
      ++at_;
    }
  }
  char peek() const { return at_ < s_.size() ? s_[at_] : '\0'; }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++at_;
  }
  bool is_digit() const { return peek() >= '0' && peek() <= '9'; }
  void digits() {
    if (!is_digit()) fail("expected a digit");
    while (is_digit()) ++at_;
  }

  Json value() {
    skip_space();
    Json v;
    const char c = peek();
    if (c == '{') {
      v.kind = Json::Kind::kObject;
      ++at_;
      skip_space();
      if (peek() == '}') {
        ++at_;
        return v;
      }
      for (;;) {
        skip_space();
        std::string key = string();
        skip_space();
        expect(':');
        v.keys.push_back(std::move(key));
        v.values.push_back(value());
        skip_space();
        if (peek() == '}') {
          ++at_;
          return v;
        }
        expect(',');
      }
    }
    if (c == '[') {
      v.kind = Json::Kind::kArray;
      ++at_;
      skip_space();
      if (peek() == ']') {
        ++at_;
        return v;
      }
      for (;;) {
        v.items.push_back(value());
        skip_space();
        if (peek() == ']') {
          ++at_;
          return v;
        }
        expect(',');
      }
    }
    if (c == '"') {
      v.kind = Json::Kind::kString;
      v.text = string();
      return v;
    }
    for (const char* word : {"true", "false", "null"}) {
      if (s_.compare(at_, std::string(word).size(), word) == 0) {
        v.kind = word[0] == 'n' ? Json::Kind::kNull : Json::Kind::kBool;
        v.text = word;
        at_ += std::string(word).size();
        return v;
      }
    }
    // -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
    const std::size_t start = at_;
    if (peek() == '-') ++at_;
    if (peek() == '0') {
      ++at_;
    } else {
      digits();
    }
    if (peek() == '.') {
      ++at_;
      digits();
    }
    if (peek() == 'e' || peek() == 'E') {
      ++at_;
      if (peek() == '+' || peek() == '-') ++at_;
      digits();
    }
    v.kind = Json::Kind::kNumber;
    v.text = s_.substr(start, at_ - start);
    return v;
  }

  std::string string() {
    expect('"');
    std::string out;
    for (;;) {
      if (at_ >= s_.size()) fail("unterminated string");
      const char c = s_[at_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("raw control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      const char e = peek();
      ++at_;
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out += e;
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          unsigned code = 0;
          const char* first = s_.data() + at_;
          if (at_ + 4 > s_.size() || std::from_chars(first, first + 4, code, 16).ptr != first + 4) {
            fail("bad \\u escape");
          }
          at_ += 4;
          // UTF-8 of the code unit; the span names checked here are ASCII anyway.
          if (code < 0x80) {
            out += static_cast<char>(code);
          } else if (code < 0x800) {
            out += static_cast<char>(0xC0 | (code >> 6));
            out += static_cast<char>(0x80 | (code & 0x3F));
          } else {
            out += static_cast<char>(0xE0 | (code >> 12));
            out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (code & 0x3F));
          }
          break;
        }
        default:
          --at_;
          fail("bad escape");
      }
    }
  }

  const std::string& s_;
  std::size_t at_ = 0;
};

// An integer member of an event (ts, dur, pid, tid); nullopt if missing or not an integer.
std::optional<std::int64_t> integer(const Json& event, const std::string& key) {
  const Json* v = event.find(key);
  if (!v || v->kind != Json::Kind::kNumber) return std::nullopt;
  std::int64_t out = 0;
  const char* end = v->text.data() + v->text.size();
  const auto [ptr, ec] = std::from_chars(v->text.data(), end, out);
  if (ec != std::errc() || ptr != end) return std::nullopt;
  return out;
}

std::optional<std::string> text(const Json& event, const std::string& key) {
  const Json* v = event.find(key);
  if (!v || v->kind != Json::Kind::kString) return std::nullopt;
  return v->text;
}

// One "ph":"X" (complete) event.
struct Span {
  std::string name, category;
  std::int64_t start, duration, pid, tid;
  std::int64_t end() const { return start + duration; }
};

// The run's launcher and trainer: 3 ranks, 3 steps of a small MLP (about a second).
std::string train_command() {
  return testing::build_dir() + "/tools/gradsync-run -n " + std::to_string(kRanks) +
         " --no-prefix -- " + testing::build_dir() + "/examples/gradsync-train --max-steps " +
         std::to_string(kSteps) + " --quiet --model mlp --hidden 64,64";
}

bool have_data() {
  return std::filesystem::exists("/usr/share/datasets/fashion-mnist");
}

TEST(TrainerTimeline, ThreeRanksWriteOneTraceWithARowPerRankOnOneClock) {
  if (!have_data()) GTEST_SKIP() << "no data";
  const testing::TempDir dir;  // removes the trace with it
  const std::string path = dir.path() + "/timeline.json";
  const auto r = testing::run_shell("GRADSYNC_TIMELINE=" + path + " " + train_command());
  ASSERT_EQ(r.status, 0) << r.output;

  const std::string trace = testing::read_file(path);
  Json root;
  try {
    root = JsonParser(trace).parse();
  } catch (const std::exception& e) {
    FAIL() << "the timeline is not JSON: " << e.what();
  }
  ASSERT_EQ(root.kind, Json::Kind::kObject);
  const Json* events = root.find("traceEvents");
  ASSERT_TRUE(events && events->kind == Json::Kind::kArray) << trace.substr(0, 200);

  std::map<std::int64_t, std::vector<std::string>> process_names;  // pid -> its names
  std::map<std::int64_t, std::vector<Span>> spans;                 // pid -> its X events
  std::size_t complete = 0;
  for (const Json& e : events->items) {
    ASSERT_EQ(e.kind, Json::Kind::kObject);
    const auto ph = text(e, "ph");
    ASSERT_TRUE(ph);
    if (*ph == "M" && text(e, "name") == "process_name") {
      const auto pid = integer(e, "pid");
      const Json* args = e.find("args");
      ASSERT_TRUE(pid && args);
      const auto name = text(*args, "name");
      ASSERT_TRUE(name);
      process_names[*pid].push_back(*name);
    } else if (*ph == "X") {
      const auto name = text(e, "name"), category = text(e, "cat");
      const auto ts = integer(e, "ts"), dur = integer(e, "dur"), pid = integer(e, "pid"),
                 tid = integer(e, "tid");
      ASSERT_TRUE(name && category && ts && dur && pid && tid);
      EXPECT_GE(*dur, 0) << *name << " of pid " << *pid;
      EXPECT_GE(*tid, 0) << *name << " of pid " << *pid;
      spans[*pid].push_back({*name, *category, *ts, *dur, *pid, *tid});
      ++complete;
    }
  }

  // The trainer reports what write() returned: every rank's spans, all in the file.
  const std::string said = "timeline of ";
  const auto at = r.output.find(said);
  ASSERT_NE(at, std::string::npos) << r.output;
  EXPECT_EQ(std::stoul(r.output.substr(at + said.size())), complete) << r.output;

  // One row per rank, named for it, and no event outside those rows.
  ASSERT_EQ(process_names.size(), static_cast<std::size_t>(kRanks));
  for (int rank = 0; rank < kRanks; ++rank) {
    EXPECT_EQ(process_names[rank], std::vector<std::string>{"rank " + std::to_string(rank)});
  }
  ASSERT_EQ(spans.size(), static_cast<std::size_t>(kRanks));
  for (const auto& [pid, mine] : spans) EXPECT_TRUE(process_names.count(pid)) << pid;

  // What each rank did: per-layer spans from the model (examples/train/model.cc: parameter
  // layers by name, activations by position), the trainer's whole-pass and optimizer spans
  // (examples/train/training.cc), the reducer's bucket all-reduces (src/ddp/reducer.cc).
  const std::vector<std::string> layers = {"fc1", "act1", "fc2", "act3", "fc3"};
  std::set<std::string> buckets_of_rank0;
  for (int rank = 0; rank < kRanks; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    std::map<std::string, int> count;
    std::set<std::string> buckets;
    for (const Span& s : spans[rank]) {
      ++count[s.name];
      if (s.name.starts_with("forward") || s.name.starts_with("backward")) {
        EXPECT_EQ(s.category, "compute") << s.name;
      }
      if (s.name.starts_with("allreduce bucket ")) {
        EXPECT_EQ(s.category, "comm") << s.name;
        buckets.insert(s.name);
      }
      if (s.name == "optimizer") {
        EXPECT_EQ(s.category, "optimizer");
      }
    }
    for (const std::string& layer : layers) {
      // Forward also runs in the test-set evaluation after the last step; backward does not.
      EXPECT_GE(count["forward " + layer], kSteps) << layer;
      EXPECT_EQ(count["backward " + layer], kSteps) << layer;
    }
    EXPECT_EQ(count["forward"], kSteps);
    EXPECT_EQ(count["backward"], kSteps);
    EXPECT_EQ(count["optimizer"], kSteps);
    // Every bucket is all-reduced once a step, and every rank has the same buckets.
    EXPECT_FALSE(buckets.empty());
    for (const std::string& b : buckets) EXPECT_EQ(count[b], kSteps) << b;
    if (rank == 0) {
      buckets_of_rank0 = buckets;
    } else {
      EXPECT_EQ(buckets, buckets_of_rank0);
    }
  }

  // One clock: the ranks ran their steps at the same time, so the windows from each rank's
  // first "forward" to its last "optimizer" have a common point.
  std::int64_t latest_start = INT64_MIN, earliest_end = INT64_MAX;
  for (int rank = 0; rank < kRanks; ++rank) {
    std::int64_t first = INT64_MAX, last = INT64_MIN;
    for (const Span& s : spans[rank]) {
      if (s.name == "forward") first = std::min(first, s.start);
      if (s.name == "optimizer") last = std::max(last, s.end());
    }
    ASSERT_LE(first, last) << "rank " << rank;
    latest_start = std::max(latest_start, first);
    earliest_end = std::min(earliest_end, last);
  }
  EXPECT_LE(latest_start, earliest_end) << "the ranks' steps do not overlap in time";
  // Sharper, and by causality rather than timing: no rank can finish an all-reduce before
  // every rank has started it (its result needs every rank's input), so the k-th all-reduce
  // of a bucket on every rank has a common point, whatever the load on the machine.
  for (const std::string& bucket : buckets_of_rank0) {
    std::vector<std::vector<Span>> of_rank(kRanks);
    for (int rank = 0; rank < kRanks; ++rank) {
      for (const Span& s : spans[rank]) {
        if (s.name == bucket) of_rank[rank].push_back(s);
      }
      std::sort(of_rank[rank].begin(), of_rank[rank].end(),
                [](const Span& a, const Span& b) { return a.start < b.start; });
      ASSERT_EQ(of_rank[rank].size(), static_cast<std::size_t>(kSteps)) << bucket;
    }
    for (int step = 0; step < kSteps; ++step) {
      std::int64_t started = INT64_MIN, ended = INT64_MAX;
      for (int rank = 0; rank < kRanks; ++rank) {
        started = std::max(started, of_rank[rank][step].start);
        ended = std::min(ended, of_rank[rank][step].end());
      }
      EXPECT_LE(started, ended) << bucket << " of step " << step + 1
                                << ": a rank finished before another started";
    }
  }
}

TEST(TrainerTimeline, NothingIsWrittenWithoutGradsyncTimeline) {
  if (!have_data()) GTEST_SKIP() << "no data";
  // Unset, and set but empty: both mean off. The ranks run in an empty directory, where a
  // trace under some default name would show.
  for (const std::string env : {"env -u GRADSYNC_TIMELINE", "env GRADSYNC_TIMELINE="}) {
    SCOPED_TRACE(env);
    const testing::TempDir dir;
    const auto r = testing::run_shell("cd " + dir.path() + " && " + env + " " + train_command());
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_FALSE(contains(r.output, "timeline")) << r.output;
    EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  }
}

}  // namespace
}  // namespace gradsync
