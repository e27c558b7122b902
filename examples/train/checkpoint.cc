// gradsync-train's checkpoint files: their layout (see encode), the atomic writes that keep
// LATEST naming a complete set, and reading a set back.
#include "train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <stdexcept>

#include "gradsync/bytes.h"

namespace train {
namespace {

// The layout of a rank's file (gradsync/bytes.h): a new layout takes the next number.
constexpr std::uint32_t kFormatVersion = 2;

std::span<const std::uint8_t> bytes_of(const std::string& text) {
  return {reinterpret_cast<const std::uint8_t*>(text.data()), text.size()};
}

void write_atomically(const std::string& path, std::span<const std::uint8_t> bytes,
                      bool crash_before_rename) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw std::runtime_error("cannot write " + tmp + ": " + std::strerror(errno));
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      ::close(fd);
      throw std::runtime_error("cannot write " + tmp + ": " + std::strerror(errno));
    }
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    throw std::runtime_error("cannot sync " + tmp + ": " + std::strerror(errno));
  }
  if (crash_before_rename) std::abort();  // tests: a crash in the middle of a save
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    throw std::runtime_error("cannot rename " + tmp + ": " + std::strerror(errno));
  }
  const std::string dir = path.substr(0, path.find_last_of('/') + 1);
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {  // the rename itself durable
    ::fsync(dfd);
    ::close(dfd);
  }
}

std::string rank_file(const std::string& dir, long step, int rank) {
  return dir + "/step-" + std::to_string(step) + ".rank-" + std::to_string(rank) + ".ckpt";
}

// "GSTC" v2: u64 ranks, u64 parameters, the position (u64 steps done, u64 epoch, u64 step),
// then the model's values, the optimizer state and the reducer state.
std::vector<std::uint8_t> encode(const RankState& state, const Position& at) {
  gradsync::ByteWriter w("GSTC", kFormatVersion);
  w.put(static_cast<std::uint64_t>(state.ctx.size()));
  w.put(static_cast<std::uint64_t>(state.model.values().size()));
  w.put(static_cast<std::uint64_t>(at.steps_done));
  w.put(static_cast<std::uint64_t>(at.epoch));
  w.put(static_cast<std::uint64_t>(at.step));
  w.floats(state.model.values());
  w.bytes(state.zero ? state.zero->save_state() : state.optimizer->save_state());
  w.bytes(state.reducer ? state.reducer->save_state() : std::vector<std::uint8_t>());
  return w.take();
}

// Rank 0, once every rank's file is in place: the cost model every rank chose by (rank 0's),
// then LATEST, which makes the new set the one a resume reads.
void name_latest(const std::string& dir, gradsync::Context& ctx, long steps_done) {
  write_atomically(cost_model_file(dir), bytes_of(ctx.cost_model()), false);
  write_atomically(dir + "/LATEST", bytes_of(std::to_string(steps_done) + "\n"), false);
}

// This rank's files of older sets, which LATEST no longer names.
void remove_older_files(const std::string& dir, int rank, long steps_done) {
  const std::string mine = ".rank-" + std::to_string(rank) + ".ckpt";
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("step-", 0) == 0 && name.size() > mine.size() &&
        name.compare(name.size() - mine.size(), mine.size(), mine) == 0 &&
        entry.path().string() != rank_file(dir, steps_done, rank)) {
      std::filesystem::remove(entry.path());
    }
  }
}

long latest_step(const std::string& dir) {
  const auto latest_bytes = read_file(dir + "/LATEST");
  return std::stol(std::string(latest_bytes.begin(), latest_bytes.end()));
}

// The file's position, after checking it was written for this run's shape; then its state.
Position restore(gradsync::ByteReader& in, const RankState& state) {
  const auto world = static_cast<std::uint64_t>(state.ctx.size());
  const std::uint64_t total = state.model.values().size();
  const auto ranks = in.get<std::uint64_t>(), parameters = in.get<std::uint64_t>();
  if (ranks != world || parameters != total) {
    in.fail("written by " + std::to_string(ranks) + " ranks for " + std::to_string(parameters) +
            " parameters; this run has " + std::to_string(world) + " and " + std::to_string(total));
  }
  Position at;
  at.steps_done = static_cast<long>(in.get<std::uint64_t>());
  at.epoch = static_cast<int>(in.get<std::uint64_t>());
  at.step = in.get<std::uint64_t>();
  in.floats(state.model.values());
  const auto optimizer_state = in.bytes();
  const auto reducer_state = in.bytes();
  in.finish();
  if (state.zero) {
    state.zero->load_state(optimizer_state);
  } else {
    state.optimizer->load_state(optimizer_state);
  }
  if (state.reducer) state.reducer->load_state(reducer_state);
  return at;
}

}  // namespace

std::string cost_model_file(const std::string& dir) {
  return dir + "/COST_MODEL";
}

std::vector<std::uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path + ": " + std::strerror(errno));
  return std::vector<std::uint8_t>(std::istreambuf_iterator<char>(f), {});
}

void save_checkpoint(const std::string& dir, const RankState& state, const Position& at,
                     int saves) {
  const int rank = state.ctx.rank();
  std::filesystem::create_directories(dir);
  const char* crash = std::getenv("GRADSYNC_TRAIN_CRASH_AT_SAVE");  // tests only
  const bool crash_now = crash && rank == 0 && std::atoi(crash) == saves;
  write_atomically(rank_file(dir, at.steps_done, rank), encode(state, at), crash_now);
  state.ctx.barrier();  // every rank's file is in place before LATEST names the step
  if (rank == 0) name_latest(dir, state.ctx, at.steps_done);
  state.ctx.barrier();
  remove_older_files(dir, rank, at.steps_done);
}

Position load_checkpoint(const std::string& dir, const RankState& state, bool announce) {
  const std::string path = rank_file(dir, latest_step(dir), state.ctx.rank());
  const std::vector<std::uint8_t> bytes = read_file(path);
  gradsync::ByteReader in(bytes, "GSTC", kFormatVersion, "checkpoint " + path);
  const Position at = restore(in, state);
  if (announce) {
    std::fprintf(stderr, "gradsync-train: resumed from %s at step %ld (epoch %d, step %zu)\n",
                 path.c_str(), at.steps_done, at.epoch + 1, at.step);
  }
  return at;
}

}  // namespace train
