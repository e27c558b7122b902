// The trainer's data: Fashion-MNIST as Debian installs it (counts, class balance, pixel
// range, the labels against an independent gzread of the file), every kind of damaged file
// written here by hand (each must name its path and what is wrong), and the sharded sampler
// (disjoint, equal, deterministic shards that change every epoch).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <stdexcept>

#include "harness.h"
#include "train/fashion_mnist.h"

namespace train {
namespace {

using gradsync::testing::contains;
using gradsync::testing::TempDir;
using Bytes = std::vector<std::uint8_t>;

bool have_real_data() {
  return std::filesystem::exists(std::string(kFashionMnistDir) + "/train-images-idx3-ubyte.gz");
}

#define SKIP_WITHOUT_REAL_DATA()                                                      \
  if (!have_real_data()) {                                                            \
    GTEST_SKIP() << kFashionMnistDir << " is absent (Debian: dataset-fashion-mnist)"; \
  }

// The first `n` decompressed bytes of a real file, read the simple way (gzread), to check
// the loader against something that does not share its code.
Bytes gzread_prefix(const std::string& path, std::size_t n) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) throw std::runtime_error("gzopen " + path);
  Bytes out(n);
  const int got = gzread(f, out.data(), static_cast<unsigned>(n));
  gzclose(f);
  if (got < 0 || static_cast<std::size_t>(got) != n) throw std::runtime_error("gzread " + path);
  return out;
}

void put_be32(Bytes& b, std::uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) b.push_back(static_cast<std::uint8_t>(v >> shift));
}

// An IDX3 file of `count` images of rows x cols, pixel k of the file being k % 251 (a
// pattern that does not repeat with the 784-byte image stride).
Bytes idx_images(std::uint32_t count, std::uint32_t rows = 28, std::uint32_t cols = 28,
                 std::uint32_t magic = 0x00000803) {
  Bytes b;
  put_be32(b, magic);
  put_be32(b, count);
  put_be32(b, rows);
  put_be32(b, cols);
  for (std::size_t k = 0; k < std::size_t{count} * rows * cols; ++k) {
    b.push_back(static_cast<std::uint8_t>(k % 251));
  }
  return b;
}

Bytes idx_labels(const Bytes& labels, std::uint32_t magic = 0x00000801) {
  Bytes b;
  put_be32(b, magic);
  put_be32(b, static_cast<std::uint32_t>(labels.size()));
  b.insert(b.end(), labels.begin(), labels.end());
  return b;
}

// One gzip member (header, deflate data, CRC-32 and length trailer), built in memory so
// the tests can cut or damage it.
Bytes gzip(const Bytes& data) {
  z_stream z{};
  if (deflateInit2(&z, 6, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) != Z_OK) {
    throw std::runtime_error("deflateInit2");
  }
  Bytes out(deflateBound(&z, data.size()));
  z.next_in = const_cast<Bytes::value_type*>(data.data());
  z.avail_in = static_cast<uInt>(data.size());
  z.next_out = out.data();
  z.avail_out = static_cast<uInt>(out.size());
  const int ret = deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  if (ret != Z_STREAM_END) throw std::runtime_error("deflate");
  return out;
}

void write_file(const std::string& path, const Bytes& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

const Bytes kThreeLabels = {9, 0, 3};

// A small, valid training split in its own directory, which each case then damages.
struct SmallSet {
  std::string dir, images, labels;
  SmallSet(const TempDir& tmp, const std::string& name) {
    dir = tmp.path() + "/" + name;
    std::filesystem::create_directories(dir);
    images = dir + "/train-images-idx3-ubyte.gz";
    labels = dir + "/train-labels-idx1-ubyte.gz";
    write_file(images, gzip(idx_images(3)));
    write_file(labels, gzip(idx_labels(kThreeLabels)));
  }
};

// Loading `dir` must throw a runtime_error naming `path` and containing `reason`.
void expect_load_error(const std::string& dir, const std::string& path, const std::string& reason) {
  try {
    load_fashion_mnist(dir, true);
  } catch (const std::runtime_error& e) {
    EXPECT_TRUE(contains(e.what(), path)) << "message does not name " << path << ": " << e.what();
    EXPECT_TRUE(contains(e.what(), reason)) << "expected '" << reason << "' in: " << e.what();
    return;
  }
  ADD_FAILURE() << "loading " << dir << " did not throw (expected " << reason << ")";
}

TEST(FashionMnist, LoadsTheTrainingSplit) {
  SKIP_WITHOUT_REAL_DATA();
  const auto start = std::chrono::steady_clock::now();
  const Dataset d = load_fashion_mnist(kFashionMnistDir, true);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Reported, not asserted: a loaded CI machine must not turn this into a flaky failure.
  std::printf("train split loaded in %.3f s\n", seconds);
  RecordProperty("train_load_ms", static_cast<int>(seconds * 1000));

  ASSERT_EQ(d.count, 60000u);
  EXPECT_EQ(d.rows, 28u);
  EXPECT_EQ(d.cols, 28u);
  ASSERT_EQ(d.pixels.size(), 60000u * 28 * 28);
  ASSERT_EQ(d.labels.size(), 60000u);
  std::array<int, 10> histogram{};
  for (std::uint8_t l : d.labels) ++histogram.at(l);
  for (int c = 0; c < 10; ++c) EXPECT_EQ(histogram[c], 6000) << "class " << c;
  const auto [lo, hi] = std::minmax_element(d.pixels.begin(), d.pixels.end());
  EXPECT_EQ(*lo, 0);
  EXPECT_EQ(*hi, 255);

  // Against the file itself rather than a remembered value: the labels header, then the
  // first labels and the first image byte for byte.
  const std::string dir = kFashionMnistDir;
  const Bytes labels = gzread_prefix(dir + "/train-labels-idx1-ubyte.gz", 8 + 16);
  for (std::size_t i = 0; i < 16; ++i) EXPECT_EQ(d.labels[i], labels[8 + i]) << "label " << i;
  EXPECT_EQ(d.labels[0], 9);  // ankle boot, as the file says
  const Bytes pixels = gzread_prefix(dir + "/train-images-idx3-ubyte.gz", 16 + 2 * 784);
  std::vector<float> two(2 * 784);
  d.image_into(0, two.data());
  d.image_into(1, two.data() + 784);
  for (std::size_t i = 0; i < 2 * 784; ++i) {
    ASSERT_EQ(d.pixels[i], pixels[16 + i]) << "pixel " << i;
    ASSERT_EQ(two[i], static_cast<float>(pixels[16 + i]) / 255.0f) << "pixel " << i;
  }
}

TEST(FashionMnist, LoadsTheTestSplit) {
  SKIP_WITHOUT_REAL_DATA();
  const Dataset d = load_fashion_mnist(kFashionMnistDir, false);
  ASSERT_EQ(d.count, 10000u);
  ASSERT_EQ(d.pixels.size(), 10000u * 28 * 28);
  ASSERT_EQ(d.labels.size(), 10000u);
  std::array<int, 10> histogram{};
  for (std::uint8_t l : d.labels) ++histogram.at(l);
  for (int c = 0; c < 10; ++c) EXPECT_EQ(histogram[c], 1000) << "class " << c;
  const Bytes labels =
      gzread_prefix(std::string(kFashionMnistDir) + "/t10k-labels-idx1-ubyte.gz", 9);
  EXPECT_EQ(d.labels[0], labels[8]);
}

TEST(FashionMnist, LoadsAHandWrittenSetExactly) {
  TempDir tmp;
  const SmallSet set(tmp, "ok");
  const Dataset d = load_fashion_mnist(set.dir + "/", true);  // a trailing slash is fine
  ASSERT_EQ(d.count, 3u);
  EXPECT_EQ(d.labels, kThreeLabels);
  ASSERT_EQ(d.pixels.size(), 3u * 784);
  std::vector<float> image(784);
  for (std::size_t i = 0; i < 3; ++i) {
    d.image_into(i, image.data());
    for (std::size_t k = 0; k < 784; ++k) {
      ASSERT_EQ(d.pixels[i * 784 + k], (i * 784 + k) % 251) << i << " " << k;
      ASSERT_EQ(image[k], static_cast<float>((i * 784 + k) % 251) / 255.0f) << i << " " << k;
    }
  }
}

TEST(FashionMnist, AcceptsAFileOfSeveralGzipMembers) {
  // gzip(1) and gzread() accept concatenated members (e.g. `cat a.gz b.gz`), so do we.
  TempDir tmp;
  const SmallSet set(tmp, "members");
  const Bytes whole = idx_labels(kThreeLabels);
  Bytes two = gzip(Bytes(whole.begin(), whole.begin() + 5));
  const Bytes rest = gzip(Bytes(whole.begin() + 5, whole.end()));
  two.insert(two.end(), rest.begin(), rest.end());
  write_file(set.labels, two);
  EXPECT_EQ(load_fashion_mnist(set.dir, true).labels, kThreeLabels);
}

TEST(FashionMnist, DamagedGzipIsNamed) {
  TempDir tmp;
  {
    const SmallSet set(tmp, "truncated_gzip");
    const Bytes gz = gzip(idx_images(3));
    write_file(set.images,
               Bytes(gz.begin(), gz.begin() + static_cast<std::ptrdiff_t>(gz.size() / 2)));
    expect_load_error(set.dir, set.images, "truncated gzip stream");
  }
  {
    const SmallSet set(tmp, "trailer_cut");  // all the data, but no CRC/length trailer
    const Bytes gz = gzip(idx_labels(kThreeLabels));
    write_file(set.labels, Bytes(gz.begin(), gz.end() - 4));
    expect_load_error(set.dir, set.labels, "truncated gzip stream");
  }
  {
    const SmallSet set(tmp, "not_gzip");
    write_file(set.images, idx_images(3));  // the IDX bytes, never compressed
    expect_load_error(set.dir, set.images, "not a gzip file");
  }
  {
    const SmallSet set(tmp, "empty");
    write_file(set.labels, {});
    expect_load_error(set.dir, set.labels, "empty file");
  }
  {
    const SmallSet set(tmp, "bad_deflate");
    Bytes gz = gzip(idx_images(3));
    for (std::size_t i = 12; i < 40; ++i) gz[i] ^= 0xa5;  // inside the deflate data
    write_file(set.images, gz);
    expect_load_error(set.dir, set.images, "corrupt gzip data");
  }
  {
    const SmallSet set(tmp, "bad_crc");  // inflates fine, but is not what was written
    Bytes gz = gzip(idx_labels(kThreeLabels));
    gz[gz.size() - 8] ^= 0xff;
    write_file(set.labels, gz);
    expect_load_error(set.dir, set.labels, "corrupt gzip data");
  }
  {
    const SmallSet set(tmp, "junk_after");
    Bytes gz = gzip(idx_labels(kThreeLabels));
    gz.insert(gz.end(), {'j', 'u', 'n', 'k'});
    write_file(set.labels, gz);
    expect_load_error(set.dir, set.labels, "4 bytes after the end of the gzip stream");
  }
}

TEST(FashionMnist, DamagedIdxIsNamed) {
  TempDir tmp;
  {
    const SmallSet set(tmp, "magic_images");  // a labels file where the images belong
    write_file(set.images, gzip(idx_labels(kThreeLabels)));
    expect_load_error(set.dir, set.images, "wrong magic 0x00000801, expected 0x00000803");
  }
  {
    const SmallSet set(tmp, "magic_labels");
    write_file(set.labels, gzip(idx_labels(kThreeLabels, 0x00000d01)));
    expect_load_error(set.dir, set.labels, "wrong magic 0x00000d01, expected 0x00000801");
  }
  {
    const SmallSet set(tmp, "dims");
    write_file(set.images, gzip(idx_images(3, 28, 27)));
    expect_load_error(set.dir, set.images, "wrong dims: 3 x 28 x 27, expected count x 28 x 28");
  }
  {
    const SmallSet set(tmp, "short_header");
    const Bytes idx = idx_images(3);
    write_file(set.images, gzip(Bytes(idx.begin(), idx.begin() + 10)));
    expect_load_error(set.dir, set.images, "truncated: 10 bytes, shorter than the 16-byte");
  }
  {
    const SmallSet set(tmp, "short_pixels");
    const Bytes idx = idx_images(3);
    write_file(set.images, gzip(Bytes(idx.begin(), idx.begin() + 16 + 2000)));
    expect_load_error(set.dir, set.images,
                      "truncated: header promises 2352 bytes of pixels, file holds 2000");
  }
  {
    // A header promising 2^32-1 images from a tiny file: reported, not allocated for.
    const SmallSet set(tmp, "huge_count");
    Bytes idx = idx_images(3);
    std::fill(idx.begin() + 4, idx.begin() + 8, 0xff);
    write_file(set.images, gzip(idx));
    expect_load_error(set.dir, set.images,
                      "the header counts 4294967295 images, more than the 1048576");
  }
  {
    const SmallSet set(tmp, "huge_label_count");
    Bytes idx = idx_labels(kThreeLabels);
    std::fill(idx.begin() + 4, idx.begin() + 8, 0xff);
    write_file(set.labels, gzip(idx));
    expect_load_error(set.dir, set.labels,
                      "the header counts 4294967295 labels, more than the 1048576");
  }
  {
    // Within the limit, yet more than the file can hold: counted, not allocated for.
    const SmallSet set(tmp, "large_count");
    Bytes idx = idx_images(3);
    idx[6] = 0x10;  // 4099 images
    write_file(set.images, gzip(idx));
    expect_load_error(set.dir, set.images,
                      "truncated: header promises 3213616 bytes of pixels, file holds 2352");
  }
  {
    const SmallSet set(tmp, "short_labels");
    Bytes idx = idx_labels(kThreeLabels);
    idx.pop_back();
    write_file(set.labels, gzip(idx));
    expect_load_error(set.dir, set.labels, "truncated: header promises 3 labels, file holds 2");
  }
  {
    const SmallSet set(tmp, "trailing");
    Bytes idx = idx_images(3);
    idx.insert(idx.end(), 5, 0);
    write_file(set.images, gzip(idx));
    expect_load_error(set.dir, set.images, "trailing bytes: 5 bytes after the 2352 bytes");
  }
  {
    const SmallSet set(tmp, "count_mismatch");
    write_file(set.labels, gzip(idx_labels({1, 2})));
    expect_load_error(set.dir, set.images, "count mismatch: 3 images");
    expect_load_error(set.dir, set.labels, "holds 2 labels");
  }
  {
    const SmallSet set(tmp, "label10");
    write_file(set.labels, gzip(idx_labels({1, 10, 2})));
    expect_load_error(set.dir, set.labels, "label 10 at index 1 is out of range 0..9");
  }
}

TEST(FashionMnist, MissingFilesAreNamed) {
  TempDir tmp;
  expect_load_error(tmp.path() + "/no-such-dir",
                    tmp.path() + "/no-such-dir/train-images-idx3-ubyte.gz",
                    "cannot open: No such file or directory");
  {
    const SmallSet set(tmp, "no_labels");
    std::filesystem::remove(set.labels);
    expect_load_error(set.dir, set.labels, "cannot open");
  }
  {
    const SmallSet set(tmp, "directory");
    std::filesystem::remove(set.images);
    std::filesystem::create_directory(set.images);
    expect_load_error(set.dir, set.images, "is a directory, not a regular file");
  }
  // The test split is looked for under its own names.
  const SmallSet set(tmp, "train_only");
  try {
    load_fashion_mnist(set.dir, false);
    ADD_FAILURE() << "no t10k files, yet the test split loaded";
  } catch (const std::runtime_error& e) {
    EXPECT_TRUE(contains(e.what(), set.dir + "/t10k-images-idx3-ubyte.gz")) << e.what();
  }
}

// What is no data file is refused by what it is, before a byte is read: a FIFO (which blocked
// the loader forever), /dev/zero behind a symlink (read until memory ran out), a file larger
// than any data set's.
TEST(FashionMnist, OnlyRegularFilesOfASaneSize) {
  TempDir tmp;
  {
    const SmallSet set(tmp, "fifo");
    std::filesystem::remove(set.images);
    ASSERT_EQ(::mkfifo(set.images.c_str(), 0600), 0);
    expect_load_error(set.dir, set.images, "is a FIFO, not a regular file");
  }
  {
    const SmallSet set(tmp, "dev_zero");
    std::filesystem::remove(set.labels);
    std::filesystem::create_symlink("/dev/zero", set.labels);
    expect_load_error(set.dir, set.labels, "is a character device, not a regular file");
  }
  {
    const SmallSet set(tmp, "huge");  // sparse: no disk space taken
    std::filesystem::resize_file(set.images, (std::uintmax_t{1} << 30) + 1);
    expect_load_error(set.dir, set.images, "1073741825 bytes, more than the 1073741824");
  }
}

// An empty set is an error, for the training split and the test split alike (an empty test
// set reported "test accuracy 0.00%" and exit 0).
TEST(FashionMnist, EmptySetIsAnError) {
  TempDir tmp;
  for (const bool train : {true, false}) {
    const std::string prefix = train ? "train" : "t10k";
    const std::string dir = tmp.path() + "/" + prefix;
    std::filesystem::create_directories(dir);
    const std::string images = dir + "/" + prefix + "-images-idx3-ubyte.gz";
    write_file(images, gzip(idx_images(0)));
    write_file(dir + "/" + prefix + "-labels-idx1-ubyte.gz", gzip(idx_labels({})));
    try {
      load_fashion_mnist(dir, train);
      ADD_FAILURE() << prefix << ": an empty set loaded";
    } catch (const std::runtime_error& e) {
      EXPECT_TRUE(contains(e.what(), images + ": empty: the header counts 0 images")) << e.what();
    }
  }
}

// Every rank's indices of `epoch`.
std::vector<std::vector<std::size_t>> shards(std::size_t count, int world, std::size_t batch,
                                             std::uint64_t seed, std::size_t epoch) {
  std::vector<std::vector<std::size_t>> out;
  for (int r = 0; r < world; ++r) {
    out.push_back(ShardedSampler(count, r, world, batch, seed).epoch_indices(epoch));
  }
  return out;
}

TEST(ShardedSampler, RanksSplitEachEpochIntoEqualDisjointShards) {
  for (int world = 1; world <= 5; ++world) {
    for (std::size_t count : {0, 1, 2, 3, 4, 7, 10, 13, 64, 101, 997, 1000}) {
      for (std::size_t batch : {1, 3, 8, 1000}) {
        for (std::size_t epoch = 0; epoch < 3; ++epoch) {
          SCOPED_TRACE("world " + std::to_string(world) + " count " + std::to_string(count) +
                       " batch " + std::to_string(batch) + " epoch " + std::to_string(epoch));
          const std::size_t per_rank = count / static_cast<std::size_t>(world);
          std::set<std::size_t> seen;
          for (int r = 0; r < world; ++r) {
            const ShardedSampler s(count, r, world, batch, 42);
            ASSERT_EQ(s.samples_per_rank(), per_rank);
            ASSERT_EQ(s.steps_per_epoch(), per_rank / batch);
            const auto mine = s.epoch_indices(epoch);
            ASSERT_EQ(mine.size(), per_rank);
            for (std::size_t i : mine) {
              ASSERT_LT(i, count);
              ASSERT_TRUE(seen.insert(i).second) << "index " << i << " on two ranks";
            }
            for (std::size_t step = 0; step < s.steps_per_epoch(); ++step) {
              const auto b = s.batch(epoch, step);
              const auto first = mine.begin() + static_cast<std::ptrdiff_t>(step * batch);
              ASSERT_EQ(b,
                        std::vector<std::size_t>(first, first + static_cast<std::ptrdiff_t>(batch)))
                  << "step " << step;
            }
            EXPECT_THROW(s.batch(epoch, s.steps_per_epoch()), std::out_of_range);
          }
          EXPECT_EQ(seen.size(), count - count % static_cast<std::size_t>(world));
        }
      }
    }
  }
}

TEST(ShardedSampler, DeterministicPerSeedAndEpochAndShuffled) {
  const std::size_t count = 1000;
  for (int world : {1, 3}) {
    EXPECT_EQ(shards(count, world, 4, 7, 0), shards(count, world, 4, 7, 0));
    EXPECT_EQ(shards(count, world, 4, 7, 5), shards(count, world, 16, 7, 5))
        << "the batch size must not change which samples a rank sees";
    EXPECT_NE(shards(count, world, 4, 7, 0), shards(count, world, 4, 7, 1));
    EXPECT_NE(shards(count, world, 4, 7, 0), shards(count, world, 4, 8, 0));
    EXPECT_NE(shards(count, world, 4, 7, 1), shards(count, world, 4, 8, 0))
        << "seed and epoch must not simply add up";
  }
  // Shuffled, not the identity or a rotation of it.
  const auto all = shards(count, 1, 1, 7, 0)[0];
  std::size_t in_place = 0, ascending = 0;
  for (std::size_t i = 0; i < count; ++i) {
    in_place += all[i] == i;
    if (i > 0) ascending += all[i] == all[i - 1] + 1;
  }
  EXPECT_LT(in_place, 10u);
  EXPECT_LT(ascending, 10u);
  // The dropped tail changes with the epoch too, so no sample is left out for good.
  std::set<std::size_t> ever;
  for (std::size_t epoch = 0; epoch < 20; ++epoch) {
    for (const auto& shard : shards(10, 4, 1, 3, epoch)) ever.insert(shard.begin(), shard.end());
  }
  EXPECT_EQ(ever.size(), 10u);
}

TEST(ShardedSampler, PermutationIsPinned) {
  // The permutation must be the same on every machine, compiler and standard library, and
  // from one release to the next (a resumed run must see the batches it would have seen).
  // These are the values of our splitmix64 + Fisher-Yates, checked against a separate
  // Python implementation of the same algorithm; a change here breaks that.
  const auto all = ShardedSampler(10, 0, 1, 1, 1234).epoch_indices(0);
  EXPECT_EQ(all, (std::vector<std::size_t>{4, 5, 0, 8, 3, 6, 7, 9, 1, 2}));
  const auto shard = ShardedSampler(23, 1, 3, 2, 99).epoch_indices(4);
  EXPECT_EQ(shard, (std::vector<std::size_t>{21, 15, 4, 7, 1, 12, 5}));
}

TEST(ShardedSampler, BatchesFollowTheirEpochWhenCallsInterleave) {
  // batch() keeps the last epoch's indices per thread; samplers of different ranks, seeds
  // and epochs asked in turn must not see each other's.
  const ShardedSampler a(100, 0, 2, 5, 1), b(100, 1, 2, 5, 1), c(100, 0, 2, 5, 2);
  for (std::size_t epoch = 0; epoch < 3; ++epoch) {
    const auto ea = a.epoch_indices(epoch), eb = b.epoch_indices(epoch),
               ec = c.epoch_indices(epoch);
    for (std::size_t step = 0; step < a.steps_per_epoch(); ++step) {
      const auto at = [&](const std::vector<std::size_t>& v) {
        return std::vector<std::size_t>(v.begin() + static_cast<std::ptrdiff_t>(step * 5),
                                        v.begin() + static_cast<std::ptrdiff_t>(step * 5 + 5));
      };
      ASSERT_EQ(a.batch(epoch, step), at(ea));
      ASSERT_EQ(b.batch(epoch, step), at(eb));
      ASSERT_EQ(c.batch(epoch, step), at(ec));
      const auto next = a.epoch_indices(epoch + 1);
      ASSERT_EQ(a.batch(epoch + 1, 0), std::vector<std::size_t>(next.begin(), next.begin() + 5));
    }
  }
}

TEST(ShardedSampler, RejectsBadArguments) {
  EXPECT_THROW(ShardedSampler(10, 0, 0, 1, 0), std::invalid_argument);
  EXPECT_THROW(ShardedSampler(10, 2, 2, 1, 0), std::invalid_argument);
  EXPECT_THROW(ShardedSampler(10, -1, 2, 1, 0), std::invalid_argument);
  EXPECT_THROW(ShardedSampler(10, 0, 1, 0, 0), std::invalid_argument);
  const ShardedSampler small(3, 0, 1, 4, 0);  // batch larger than the shard: no steps
  EXPECT_EQ(small.steps_per_epoch(), 0u);
  EXPECT_THROW(small.batch(0, 0), std::out_of_range);
}

}  // namespace
}  // namespace train
