#include "train/fashion_mnist.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <tuple>

#include "train/random.h"

namespace train {
namespace {

// Decompressed data is read in chunks of this size (zlib's avail_out is 32 bits wide; a file
// that cannot hold what its header promises is only counted, a chunk at a time).
constexpr std::size_t kChunk = std::size_t{1} << 20;

// Deflate cannot expand data by more than about 1032:1, so a header promising more than
// this many bytes from a file of a given size is lying; the loader never allocates for
// more than the file could hold (a corrupt count must not become a huge allocation).
constexpr std::uint64_t kMaxInflateRatio = 1032;

// Sane sizes: the real files are 26 MB at most and hold 60,000 images; these leave room for a
// data set twenty times larger and refuse what no such file can be (a header's 4 billion
// images, a disk image passed by mistake) before reading or allocating for it.
constexpr std::uint64_t kMaxFileBytes = std::uint64_t{1} << 30;
constexpr std::uint32_t kMaxCount = 1 << 20;

// What a file that is not a regular file is, for the message.
const char* file_type(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error(path + ": " + what);
}

std::string hex32(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", static_cast<unsigned>(v));
  return buf;
}

std::uint32_t be32(const std::uint8_t* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) |
         std::uint32_t{p[3]};
}

// A whole gzip file read into memory and inflated on demand. We drive inflate() ourselves
// rather than using gzread() because gzread() silently passes non-gzip files through,
// reports a cut-off stream only through gzerror(), and ignores junk after the stream; here
// each of those is its own error with its own message.
class GzipStream {
 public:
  explicit GzipStream(std::string path) : path_(std::move(path)) {
    read_whole_file();
    if (compressed_.empty()) fail(path_, "empty file (expected gzip data)");
    if (compressed_.size() < 2 || compressed_[0] != 0x1f || compressed_[1] != 0x8b) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "not a gzip file (starts with %02x %02x, expected 1f 8b)",
                    unsigned{compressed_[0]},
                    compressed_.size() > 1 ? unsigned{compressed_[1]} : 0u);
      fail(path_, buf);
    }
    // 16 + MAX_WBITS: gzip wrapper only, so the CRC-32 and length in the trailer are checked.
    if (inflateInit2(&z_, 16 + MAX_WBITS) != Z_OK) fail(path_, "zlib: inflateInit2 failed");
  }
  ~GzipStream() { inflateEnd(&z_); }
  GzipStream(const GzipStream&) = delete;
  GzipStream& operator=(const GzipStream&) = delete;

  std::size_t compressed_size() const { return compressed_.size(); }

  // Fills dst with up to n decompressed bytes; fewer only at the end of the data. A cut-off
  // or corrupt stream throws as soon as it is found.
  std::size_t read(std::uint8_t* dst, std::size_t n) {
    std::size_t total = 0;
    while (total < n && !done_) {
      // avail_out is 32 bits wide; our callers ask for at most kChunk anyway.
      const auto want = static_cast<uInt>(std::min<std::size_t>(n - total, UINT_MAX));
      z_.next_out = dst + total;
      z_.avail_out = want;
      inflate_into_output();
      total += want - z_.avail_out;
    }
    return total;
  }

  // Reads to the end of the data and returns how many bytes were left. Reading to the end
  // also makes zlib verify the trailer's CRC-32, so a silently damaged file is caught even
  // when the loader has already got all the bytes it wanted.
  std::uint64_t drain() {
    std::vector<std::uint8_t> scratch(kChunk);
    std::uint64_t left = 0;
    for (;;) {
      const std::size_t got = read(scratch.data(), scratch.size());
      left += got;
      if (got < scratch.size()) return left;
    }
  }

 private:
  // Regular files only, of a sane size, read to their end: a FIFO would block (at open,
  // without O_NONBLOCK, and then forever) and /dev/zero would be read until memory ran out.
  void read_whole_file() {
    const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
      const int err = errno;
      std::string what = std::string("cannot open: ") + std::strerror(err);
      if (err == ENOENT) {
        what += " (Debian's dataset-fashion-mnist package installs the files in " +
                std::string(kFashionMnistDir) + ")";
      }
      fail(path_, what);
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      fail(path_, std::string("cannot stat: ") + std::strerror(err));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      fail(path_, std::string("is ") + file_type(st.st_mode) +
                      ", not a regular file (expected a gzip-compressed IDX file)");
    }
    const auto too_large = [&](std::uint64_t size) {
      ::close(fd);
      fail(path_, std::to_string(size) + " bytes, more than the " + std::to_string(kMaxFileBytes) +
                      " a Fashion-MNIST file can be");
    };
    if (static_cast<std::uint64_t>(st.st_size) > kMaxFileBytes) too_large(st.st_size);
    // One byte more than the known size, so that the read() that finds the end finds room
    // (no regrowth, which would copy the whole file); keep reading past it in case the file
    // grew, up to the limit.
    compressed_.resize(static_cast<std::size_t>(st.st_size) + 1);
    std::size_t have = 0;
    for (;;) {
      if (have == compressed_.size()) compressed_.resize(std::max<std::size_t>(2 * have, 1 << 16));
      const ssize_t got = ::read(fd, compressed_.data() + have, compressed_.size() - have);
      if (got < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        ::close(fd);
        fail(path_, std::string("cannot read: ") + std::strerror(err));
      }
      if (got == 0) break;
      have += static_cast<std::size_t>(got);
      if (have > kMaxFileBytes) too_large(have);
    }
    ::close(fd);
    compressed_.resize(have);
  }

  void inflate_into_output() {
    while (z_.avail_out > 0 && !done_) {
      if (z_.avail_in == 0 && offset_ < compressed_.size()) {
        const auto give = std::min<std::size_t>(compressed_.size() - offset_, UINT_MAX);
        z_.next_in = compressed_.data() + offset_;
        z_.avail_in = static_cast<uInt>(give);
        offset_ += give;
      }
      const int ret = inflate(&z_, Z_NO_FLUSH);
      if (ret == Z_OK) continue;
      if (ret == Z_STREAM_END) {
        end_of_member();
        continue;
      }
      if (ret == Z_BUF_ERROR && z_.avail_in == 0 && offset_ == compressed_.size()) {
        fail(path_,
             "truncated gzip stream: the compressed data ends before the gzip trailer "
             "(incomplete download or copy?)");
      }
      if (ret == Z_BUF_ERROR) continue;  // no progress this call, more input is coming
      if (ret == Z_MEM_ERROR) fail(path_, "zlib: out of memory");
      // Z_DATA_ERROR: bad deflate data, a bad header, or a CRC/length mismatch.
      fail(path_, std::string("corrupt gzip data: ") + (z_.msg ? z_.msg : "zlib error") +
                      " (zlib code " + std::to_string(ret) + ")");
    }
  }

  // A gzip file may be several members one after another (gzip(1) and gzread() accept
  // that); anything else after a member is damage we report rather than ignore.
  void end_of_member() {
    const std::size_t pos = offset_ - z_.avail_in;
    const std::size_t rest = compressed_.size() - pos;
    if (rest == 0) {
      done_ = true;
      return;
    }
    if (rest >= 2 && compressed_[pos] == 0x1f && compressed_[pos + 1] == 0x8b) {
      if (inflateReset(&z_) != Z_OK) fail(path_, "zlib: inflateReset failed");
      return;
    }
    fail(path_, "corrupt gzip data: " + std::to_string(rest) +
                    " bytes after the end of the gzip stream are not gzip data");
  }

  std::string path_;
  LoadedBytes compressed_;
  std::size_t offset_ = 0;  // how much of compressed_ has been handed to zlib
  z_stream z_{};
  bool done_ = false;
};

// The IDX header: a 4-byte big-endian magic (0, 0, element type 0x08 = unsigned byte,
// number of dimensions) and one big-endian 32-bit size per dimension.
std::vector<std::uint32_t> read_idx_header(GzipStream& in, const std::string& path,
                                           std::uint32_t magic, int ndims, const char* kind) {
  std::array<std::uint8_t, 4 + 4 * 3> header{};
  const std::size_t want = 4 + 4 * static_cast<std::size_t>(ndims);
  const auto truncated = [&](std::size_t got) {
    fail(path, "truncated: " + std::to_string(got) + " bytes, shorter than the " +
                   std::to_string(want) + "-byte IDX header of " + kind);
  };
  // The magic first: a wrong kind of file (labels where images belong) is reported as
  // that, not as a header too short for what it was mistaken for.
  std::size_t got = in.read(header.data(), 4);
  if (got < 4) truncated(got);
  const std::uint32_t found = be32(header.data());
  if (found != magic) {
    fail(path, "wrong magic " + hex32(found) + ", expected " + hex32(magic) + " (IDX of " + kind +
                   ": unsigned bytes, " + std::to_string(ndims) + " dimensions)");
  }
  got += in.read(header.data() + 4, want - 4);
  if (got < want) truncated(got);
  std::vector<std::uint32_t> dims;
  for (int d = 0; d < ndims; ++d) dims.push_back(be32(header.data() + 4 + 4 * d));
  // An empty set trains nothing and tests to 0%; a huge count is damage, not data.
  if (dims[0] == 0) fail(path, std::string("empty: the header counts 0 ") + kind);
  if (dims[0] > kMaxCount) {
    fail(path, "the header counts " + std::to_string(dims[0]) + " " + kind + ", more than the " +
                   std::to_string(kMaxCount) + " a Fashion-MNIST file can hold");
  }
  return dims;
}

// After the `promised` bytes the header announced, the file must end.
void expect_end(GzipStream& in, const std::string& path, std::uint64_t promised, const char* what) {
  const std::uint64_t extra = in.drain();
  if (extra > 0) {
    fail(path, "trailing bytes: " + std::to_string(extra) + " bytes after the " +
                   std::to_string(promised) + " " + what + " the header promises");
  }
}

std::uint64_t max_inflated(const GzipStream& in) {
  return static_cast<std::uint64_t>(in.compressed_size()) * kMaxInflateRatio + 4096;
}

// The `promised` bytes after the header, and then the end of the file. The vector is sized
// once (no regrowth) unless the file cannot possibly hold that much, in which case we only
// count what it does hold, for the message.
LoadedBytes read_payload(GzipStream& in, const std::string& path, std::uint64_t promised,
                         const char* what) {
  LoadedBytes payload(promised <= max_inflated(in) ? promised : 0);
  std::vector<std::uint8_t> chunk(payload.empty() ? kChunk : 0);
  std::uint64_t have = 0;
  while (have < promised) {
    const auto want = static_cast<std::size_t>(std::min<std::uint64_t>(kChunk, promised - have));
    std::uint8_t* dst = payload.empty() ? chunk.data() : payload.data() + have;
    const std::size_t got = in.read(dst, want);
    have += got;
    if (got < want) break;
  }
  if (have < promised) {
    fail(path, "truncated: header promises " + std::to_string(promised) + " " + what +
                   ", file holds " + std::to_string(have));
  }
  expect_end(in, path, promised, what);
  return payload;
}

void load_images(const std::string& path, Dataset& out) {
  GzipStream in(path);
  const auto dims = read_idx_header(in, path, 0x00000803, 3, "images");
  if (dims[1] != 28 || dims[2] != 28) {
    fail(path, "wrong dims: " + std::to_string(dims[0]) + " x " + std::to_string(dims[1]) + " x " +
                   std::to_string(dims[2]) + ", expected count x 28 x 28");
  }
  const std::uint64_t promised = std::uint64_t{dims[0]} * dims[1] * dims[2];
  out.pixels = read_payload(in, path, promised, "bytes of pixels");
  out.count = dims[0];
  out.rows = dims[1];
  out.cols = dims[2];
}

void load_labels(const std::string& path, Dataset& out) {
  GzipStream in(path);
  const std::uint64_t promised = read_idx_header(in, path, 0x00000801, 1, "labels")[0];
  const LoadedBytes labels = read_payload(in, path, promised, "labels");
  const auto bad = std::find_if(labels.begin(), labels.end(), [](std::uint8_t l) { return l > 9; });
  if (bad != labels.end()) {
    fail(path, "label " + std::to_string(*bad) + " at index " +
                   std::to_string(bad - labels.begin()) + " is out of range 0..9");
  }
  out.labels.assign(labels.begin(), labels.end());
}

}  // namespace

void Dataset::image_into(std::size_t i, float* dst) const {
  const std::uint8_t* src = pixels.data() + i * pixels_per_image();
  // A division rather than a multiply by 1/255: exactly x / 255 for every byte.
  for (std::size_t k = 0; k < pixels_per_image(); ++k) dst[k] = static_cast<float>(src[k]) / 255.0f;
}

namespace {

std::vector<std::size_t> permutation(std::size_t count, std::uint64_t seed, std::size_t epoch) {
  // Seed and epoch hashed together, so neighbouring seeds or epochs give unrelated streams.
  SplitMix64 rng(SplitMix64(SplitMix64(seed).next() + static_cast<std::uint64_t>(epoch)).next());
  std::vector<std::size_t> perm(count);
  for (std::size_t i = 0; i < count; ++i) perm[i] = i;
  // Fisher-Yates, from the back.
  for (std::size_t i = count; i > 1; --i) {
    const auto j = static_cast<std::size_t>(rng.below(i));
    std::swap(perm[i - 1], perm[j]);
  }
  return perm;
}

}  // namespace

Dataset load_fashion_mnist(const std::string& dir, bool train) {
  const std::string prefix = train ? "train" : "t10k";
  const std::string images_path =
      (std::filesystem::path(dir) / (prefix + "-images-idx3-ubyte.gz")).string();
  const std::string labels_path =
      (std::filesystem::path(dir) / (prefix + "-labels-idx1-ubyte.gz")).string();
  Dataset data;
  load_images(images_path, data);
  load_labels(labels_path, data);
  if (data.labels.size() != data.count) {
    fail(images_path, "count mismatch: " + std::to_string(data.count) + " images, but " +
                          labels_path + " holds " + std::to_string(data.labels.size()) + " labels");
  }
  return data;
}

ShardedSampler::ShardedSampler(std::size_t count, int rank, int world, std::size_t batch,
                               std::uint64_t seed)
    : count_(count), batch_(batch), rank_(rank), world_(world), seed_(seed) {
  if (world < 1) throw std::invalid_argument("ShardedSampler: world must be >= 1");
  if (rank < 0 || rank >= world) {
    throw std::invalid_argument("ShardedSampler: rank " + std::to_string(rank) + " is not in 0.." +
                                std::to_string(world - 1));
  }
  if (batch < 1) throw std::invalid_argument("ShardedSampler: batch must be >= 1");
}

std::size_t ShardedSampler::samples_per_rank() const {
  return count_ / static_cast<std::size_t>(world_);
}

std::size_t ShardedSampler::steps_per_epoch() const {
  return samples_per_rank() / batch_;
}

std::vector<std::size_t> ShardedSampler::epoch_indices(std::size_t epoch) const {
  const auto world = static_cast<std::size_t>(world_);
  const std::size_t per_rank = samples_per_rank();
  const std::vector<std::size_t> perm = permutation(count_, seed_, epoch);
  // The tail perm[per_rank * world ..] is what is dropped.
  std::vector<std::size_t> mine(per_rank);
  for (std::size_t k = 0; k < per_rank; ++k)
    mine[k] = perm[static_cast<std::size_t>(rank_) + k * world];
  return mine;
}

std::vector<std::size_t> ShardedSampler::batch(std::size_t epoch, std::size_t step) const {
  if (step >= steps_per_epoch()) {
    throw std::out_of_range("ShardedSampler::batch: step " + std::to_string(step) +
                            " is past the epoch's " + std::to_string(steps_per_epoch()) + " steps");
  }
  // The trainer asks for every step of an epoch in turn; shuffling the whole data set for
  // each would cost more than a small model's step, so this thread keeps the last epoch's
  // indices (per thread: const methods stay safe to call concurrently, and the class keeps
  // its plain-value layout).
  thread_local std::tuple<std::size_t, int, int, std::uint64_t, std::size_t> key{};
  thread_local std::vector<std::size_t> cached;
  thread_local bool valid = false;
  const auto want = std::make_tuple(count_, rank_, world_, seed_, epoch);
  if (!valid || key != want) {
    cached = epoch_indices(epoch);
    key = want;
    valid = true;
  }
  const auto first = cached.begin() + static_cast<std::ptrdiff_t>(step * batch_);
  return {first, first + static_cast<std::ptrdiff_t>(batch_)};
}

}  // namespace train
