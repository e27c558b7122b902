// The saved-state format (gradsync/bytes.h): what is written reads back, and anything else
// (another kind, another version, too few bytes, bytes left over) is refused, naming it.
#include "gradsync/bytes.h"

#include <gtest/gtest.h>

#include <map>

#include "gradsync/compress.h"
#include "gradsync/optim.h"
#include "harness.h"

namespace gradsync {
namespace {

using testing::contains;
using testing::expect_error;

std::vector<std::uint8_t> sample() {
  ByteWriter w("GSXX", 3);
  w.put<std::uint32_t>(7);
  w.string("fc1.weight");
  w.floats(std::vector<float>{1.5f, -2.0f});
  w.bytes(std::vector<std::uint8_t>{9, 8});
  return w.take();
}

TEST(Bytes, WhatIsWrittenReadsBack) {
  const auto bytes = sample();
  ByteReader r(bytes, "GSXX", 3, "sample");
  EXPECT_EQ(r.get<std::uint32_t>(), 7u);
  EXPECT_EQ(r.string(), "fc1.weight");
  EXPECT_EQ(r.floats(), (std::vector<float>{1.5f, -2.0f}));
  const auto b = r.bytes();
  EXPECT_EQ(std::vector<std::uint8_t>(b.begin(), b.end()), (std::vector<std::uint8_t>{9, 8}));
  EXPECT_TRUE(r.at_end());
  r.finish();
}

TEST(Bytes, AnythingElseIsRefusedNamingWhatIsWrong) {
  const auto bytes = sample();
  auto refused = [&](std::span<const std::uint8_t> in, const char* kind, std::uint32_t version,
                     const std::string& says) {
    const Error e = expect_error(ErrorKind::kProtocol, [&] {
      ByteReader r(in, kind, version, "sample");
      r.get<std::uint32_t>();
      r.string();
      std::vector<float> two(2);
      r.floats(two);
      r.bytes();
      r.finish();
    });
    EXPECT_TRUE(contains(e.what(), "sample: " + says)) << e.what();
  };
  refused(bytes, "GSYY", 3, "not one (it starts with 'GSXX', not 'GSYY')");
  refused(bytes, "GSXX", 4, "format version 3, this build reads version 4");
  refused(std::span(bytes).first(bytes.size() - 1), "GSXX", 3, "a block longer than what is left");
  refused(std::span(bytes).first(20), "GSXX", 3, "a string longer than what is left");
  auto longer = bytes;
  longer.push_back(0);
  refused(longer, "GSXX", 3, "1 bytes left over");
  refused({}, "GSXX", 3, "not one");
}

// Maps are written in key order, each key once: a repeated or reordered key would be merged
// silently on load (the state would not re-save to the same bytes), so it is refused.
TEST(Bytes, MapKeysMustComeInOrderEachOnce) {
  auto read_keys = [](std::initializer_list<const char*> keys) {
    ByteWriter w("GSXX", 1);
    for (const char* k : keys) w.string(k);
    const auto bytes = w.take();
    ByteReader r(bytes, "GSXX", 1, "map");
    std::map<std::string, int> m;
    for (std::size_t i = 0; i < keys.size(); ++i) m[r.key_after(m)] = 0;
    r.finish();
    return m.size();
  };
  EXPECT_EQ(read_keys({"", "a", "b"}), 3u);
  Error e = expect_error(ErrorKind::kProtocol, [&] { read_keys({"a", "a"}); });
  EXPECT_TRUE(contains(e.what(), "map: entry 'a' repeated or out of order")) << e.what();
  expect_error(ErrorKind::kProtocol, [&] { read_keys({"b", "a"}); });
  expect_error(ErrorKind::kProtocol, [&] { read_keys({"", ""}); });
}

// The codec fuzzer's finding: an error-feedback state naming one tensor four times loaded as
// one entry. Every map-holding state refuses it.
TEST(Bytes, ARepeatedTensorInASavedStateIsRefused) {
  ByteWriter feedback("GSEW", 2);
  feedback.bytes({});  // the inner codec's state: none
  feedback.put<std::uint32_t>(2);
  for (int i = 0; i < 2; ++i) {
    feedback.string("w");
    feedback.floats({});
    feedback.floats({});
  }
  Error e = expect_error(ErrorKind::kProtocol, [&] {
    compress::make_codec("int8:block=16")->load_state(feedback.data());
  });
  EXPECT_TRUE(contains(e.what(), "entry 'w' repeated")) << e.what();

  ByteWriter tensors("GSRK", 1);
  tensors.put<std::uint32_t>(2);
  tensors.string("w");
  tensors.floats(std::vector<float>{0, 0});
  tensors.string("w");
  tensors.floats(std::vector<float>{0, 0});
  expect_error(ErrorKind::kProtocol,
               [&] { compress::make_codec("randomk:ratio=0.5,ef=0")->load_state(tensors.data()); });
}

// Every saved state of the library uses the format: a codec's state is refused by an
// optimizer, and the other way round, each naming what it expected.
TEST(Bytes, StatesOfOneKindAreRefusedAsAnother) {
  auto codec = compress::make_codec("topk:ratio=0.5");
  std::vector<float> g{1, 2, 3, 4};
  std::vector<std::uint8_t> payload;
  codec->encode("w", g, payload);
  auto sgd = optim::make_sgd(4, {});
  Error e = expect_error(ErrorKind::kProtocol, [&] { sgd->load_state(codec->save_state()); });
  EXPECT_TRUE(contains(e.what(), "optimizer state: not one (it starts with 'GSEW'")) << e.what();
  e = expect_error(ErrorKind::kProtocol, [&] { codec->load_state(sgd->save_state()); });
  EXPECT_TRUE(contains(e.what(), "error-feedback state: not one")) << e.what();
}

}  // namespace
}  // namespace gradsync
