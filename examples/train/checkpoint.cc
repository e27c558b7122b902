// gradsync-train's checkpoint files: their layout (see encode_checkpoint), the atomic writes
// that keep LATEST naming a complete set, reading a set back, and the checks the ranks make
// together so that they all fail alike or all go on.
#include "train/checkpoint.h"

#include <fcntl.h>
#include <gradsync/error.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <stdexcept>

#include "gradsync/bytes.h"

namespace train {
namespace {

// Bytes of the header before the checksummed contents: "GSTC", u32 version, u64 checksum.
constexpr std::size_t kVersionAt = 4, kChecksumAt = 8, kContentsAt = 16;

// 64-bit FNV-1a: enough to catch a damaged or edited file (not an adversary), and fast.
std::uint64_t fnv1a(std::span<const std::uint8_t> bytes,
                    std::uint64_t hash = 14695981039346656037ull) {
  for (const std::uint8_t b : bytes) hash = (hash ^ b) * 1099511628211ull;
  return hash;
}

std::span<const std::uint8_t> bytes_of(const std::string& text) {
  return {reinterpret_cast<const std::uint8_t*>(text.data()), text.size()};
}

std::span<const std::uint8_t> bytes_of(std::span<const float> values) {
  return {reinterpret_cast<const std::uint8_t*>(values.data()), values.size_bytes()};
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

bool is_checkpoint_name(const std::string& name) {
  return name == "LATEST" || (name.rfind("step-", 0) == 0 && name.find(".ckpt") != name.npos);
}

// ---- What each rank tells the others ------------------------------------------------------

// One rank's part of a check all ranks make together: a fixed size, so one allgather carries
// it, and whether this rank failed and why, so every rank learns it and fails alike.
struct Report {
  std::uint64_t failed = 0;
  std::int64_t steps_done = 0, epoch = 0, step = 0;
  std::uint64_t identity = 0, values = 0;
  std::int64_t written_by = 0;  // the ranks of the set a resume read
  char error[968] = {};
};
static_assert(sizeof(Report) == 1024);

void fail(Report& r, const std::string& why) {
  r.failed = 1;
  const std::size_t n = std::min(why.size(), sizeof r.error - 1);
  std::memcpy(r.error, why.data(), n);
  r.error[n] = '\0';
}

std::string message_of(const std::exception& e) {
  if (const auto* g = dynamic_cast<const gradsync::Error*>(&e)) return g->detail();
  return e.what();
}

std::vector<Report> gather(gradsync::Context& ctx, const Report& mine) {
  std::vector<Report> all(static_cast<std::size_t>(ctx.size()));
  ctx.allgather(&mine, all.data(), sizeof mine, gradsync::DataType::kUInt8);
  return all;
}

// Throws `what` followed by every failed rank's reason, on every rank alike. Ranks that failed
// alike are named together ("ranks 0, 1: ..."), their own files as "rank-<r>".
void throw_if_any_failed(const std::vector<Report>& all, const std::string& what) {
  std::vector<std::pair<std::string, std::vector<std::size_t>>> reasons;
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (!all[r].failed) continue;
    std::string reason = all[r].error;
    const std::string own = ".rank-" + std::to_string(r) + ".ckpt";
    for (auto at = reason.find(own); at != reason.npos; at = reason.find(own, at)) {
      reason.replace(at, own.size(), ".rank-<r>.ckpt");
    }
    const auto same = std::find_if(reasons.begin(), reasons.end(),
                                   [&](const auto& seen) { return seen.first == reason; });
    if (same == reasons.end()) {
      reasons.push_back({reason, {r}});
    } else {
      same->second.push_back(r);
    }
  }
  if (reasons.empty()) return;
  std::string why;
  for (const auto& [reason, ranks] : reasons) {
    std::string who = ranks.size() == 1 ? "rank " : "ranks ";
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      who += (i ? ", " : "") + std::to_string(ranks[i]);
    }
    std::string text = reason;
    if (ranks.size() == 1) {  // its own file by its name
      const std::string own = ".rank-" + std::to_string(ranks[0]) + ".ckpt";
      for (auto at = text.find(".rank-<r>.ckpt"); at != text.npos;
           at = text.find(".rank-<r>.ckpt")) {
        text.replace(at, 14, own);
      }
    }
    why += (why.empty() ? "" : "; ") + who + ": " + text;
  }
  throw std::runtime_error(what + ": " + why);
}

std::string describe_position(const Report& r) {
  return "step " + std::to_string(r.steps_done) + " (epoch " + std::to_string(r.epoch + 1) +
         ", step " + std::to_string(r.step) + ")";
}

// Throws unless every rank stands at the same position.
void check_same_position(const std::vector<Report>& all, const std::string& what) {
  bool same = true;
  for (const Report& r : all) {
    same = same && r.steps_done == all[0].steps_done && r.epoch == all[0].epoch &&
           r.step == all[0].step;
  }
  if (same) return;
  std::string where;
  for (std::size_t r = 0; r < all.size(); ++r) {
    where += (r ? ", rank " : "rank ") + std::to_string(r) + " at " + describe_position(all[r]);
  }
  throw std::runtime_error(what + ": the ranks stand at different positions: " + where);
}

// The ranks whose `field` differs from the value most ranks hold (rank 0's on a tie), as
// "1, 3", and those that hold that value; empty when every rank agrees.
std::pair<std::string, std::string> outliers(const std::vector<Report>& all,
                                             std::uint64_t Report::*field) {
  std::map<std::uint64_t, int> votes;
  for (const Report& r : all) ++votes[r.*field];
  std::uint64_t common = all[0].*field;
  for (const auto& [value, n] : votes) {
    if (n > votes[common]) common = value;
  }
  std::string odd, agreeing;
  for (std::size_t r = 0; r < all.size(); ++r) {
    std::string& list = all[r].*field == common ? agreeing : odd;
    list += (list.empty() ? "" : ", ") + std::to_string(r);
  }
  return {odd, agreeing};
}

// ---- The file ----------------------------------------------------------------------------

std::uint64_t identity_hash(const Identity& identity) {
  std::uint64_t hash = fnv1a({});
  for (const auto& [what, value] : identity) {
    hash = fnv1a(bytes_of(what + '\0' + value + '\0'), hash);
  }
  return hash;
}

// "written with --batch 32; this run has --batch 64" for each entry that differs. Flags
// recorded only where set (--amp, --weight-decay, ...) count on both sides: one the file
// has and this run lacks differs too.
std::string identity_mismatches(const Identity& written, const Identity& ours) {
  std::string why;
  const auto note = [&](const std::string& what, const std::string& theirs,
                        const std::string& value) {
    why += (why.empty() ? "" : "; ") +
           ("written with " + what + " " + theirs + "; this run has " + what + " " + value);
  };
  const auto find = [](const Identity& in, const std::string& what) {
    return std::find_if(in.begin(), in.end(),
                        [&](const auto& entry) { return entry.first == what; });
  };
  for (const auto& [what, value] : ours) {
    const auto it = find(written, what);
    const std::string theirs = it == written.end() ? "(not recorded)" : it->second;
    if (theirs != value) note(what, theirs, value);
  }
  for (const auto& [what, theirs] : written) {
    if (find(ours, what) == ours.end()) note(what, theirs, "(not given)");
  }
  return why;
}

// The position read back, refused by name where no run of these bounds could have saved it.
void check_position(const CheckpointFile& f, long latest, const Bounds& bounds) {
  if (f.steps_done < 0 || f.epoch < 0 || f.step < 0) {
    throw std::runtime_error("position out of range: steps done " + std::to_string(f.steps_done) +
                             ", epoch " + std::to_string(f.epoch) + ", step " +
                             std::to_string(f.step) + " (none may be negative)");
  }
  if (f.steps_done != latest) {
    throw std::runtime_error("holds step " + std::to_string(f.steps_done) + " where LATEST names " +
                             std::to_string(latest));
  }
  if (f.epoch > bounds.epochs || (f.epoch == bounds.epochs && f.step != 0)) {
    throw std::runtime_error("position out of range: epoch " + std::to_string(f.epoch + 1) +
                             " is beyond this run's --epochs " + std::to_string(bounds.epochs));
  }
  if (static_cast<std::uint64_t>(f.step) >= bounds.steps_per_epoch) {
    throw std::runtime_error("position out of range: step " + std::to_string(f.step) +
                             " of an epoch of " + std::to_string(bounds.steps_per_epoch) +
                             " steps");
  }
}

// Refuses a NaN or infinite weight, naming its tensor: training on would spread it to every
// weight, and saving it would replace the last good set.
void check_finite(std::span<const float> values, Model& model) {
  std::size_t at = 0;
  for (const Parameter& p : model.parameters()) {
    for (std::size_t i = 0; i < p.count; ++i) {
      const float v = values[at + i];
      if (!std::isfinite(v)) {
        throw std::runtime_error(p.name + " holds " + (std::isnan(v) ? "NaN" : "an infinity") +
                                 " at element " + std::to_string(i));
      }
    }
    at += p.count;
  }
}

CheckpointFile snapshot(const RankState& state, const Identity& identity, const Position& at,
                        std::span<const float> values) {
  CheckpointFile f;
  f.identity = identity;
  f.steps_done = at.steps_done;
  f.epoch = at.epoch;
  f.step = static_cast<std::int64_t>(at.step);
  f.values.assign(values.begin(), values.end());
  f.optimizer = state.sharded ? state.sharded->save_state() : state.optimizer->save_state();
  if (state.reducer) f.reducer = state.reducer->save_state();
  if (state.scaler) f.scaler = state.scaler->save_state();
  return f;
}

// Rank 0, once every rank's file is in place: the cost model every rank chose by (rank 0's),
// then LATEST, which makes the new set the one a resume reads.
void name_latest(const std::string& dir, gradsync::Context& ctx, long steps_done) {
  write_atomically(cost_model_file(dir), bytes_of(ctx.cost_model()), false);
  write_atomically(dir + "/LATEST", bytes_of(std::to_string(steps_done) + "\n"), false);
}

// This rank's files of older sets, which LATEST no longer names, and their temporary files
// that a crash left; rank 0 also every file of a rank a shrunk job no longer has (>= world),
// none of which LATEST names any more.
void remove_older_files(const std::string& dir, int rank, int world, long steps_done) {
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    // step-<S>.rank-<R>.ckpt or .ckpt.tmp
    const auto at = name.find(".rank-");
    if (name.rfind("step-", 0) != 0 || at == name.npos) continue;
    int owner = -1;
    const char* first = name.data() + at + 6;
    const auto [end, ec] = std::from_chars(first, name.data() + name.size(), owner);
    const std::string rest(end, name.data() + name.size());
    if (ec != std::errc() || (rest != ".ckpt" && rest != ".ckpt.tmp")) continue;
    const bool older = owner == rank && entry.path().string() != rank_file(dir, steps_done, rank);
    if (older || (rank == 0 && owner >= world)) std::filesystem::remove(entry.path());
  }
}

// The step LATEST names: a whole number >= 0 and nothing else but its newline.
long latest_step(const std::string& dir) {
  const std::string path = dir + "/LATEST";
  const auto bytes = read_file(path);
  std::string text(bytes.begin(), bytes.end());
  if (!text.empty() && text.back() == '\n') text.pop_back();
  long step = -1;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), step);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || step < 0) {
    throw std::runtime_error(path + " holds '" + text.substr(0, 40) +
                             "', not the step number of a checkpoint");
  }
  return step;
}

// The ranks of the run that wrote `f` (its "gradsync-run -n"), or `otherwise` if unrecorded.
int writers_of(const CheckpointFile& f, int otherwise) {
  for (const auto& [what, value] : f.identity) {
    int ranks = 0;
    const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), ranks);
    if (what == "gradsync-run -n" && ec == std::errc() && end == value.data() + value.size() &&
        ranks > 0) {
      return ranks;
    }
  }
  return otherwise;
}

// Where a run of `ours` steps per epoch goes on from `at` of a run whose ranks took
// `written`/`world` times as many samples per step: the same epoch, at the step where those
// samples end (the next epoch if none is left).
Position rescale(const Position& at, int written, int world, const Bounds& ours) {
  Position out{0, at.epoch,
               at.step * static_cast<std::size_t>(written) / static_cast<std::size_t>(world)};
  if (out.step >= ours.steps_per_epoch) {
    ++out.epoch;
    out.step = 0;
  }
  out.steps_done =
      static_cast<long>(static_cast<std::size_t>(out.epoch) * ours.steps_per_epoch + out.step);
  return out;
}

// ZeRO at another number of ranks: the sharded optimizer state of every rank of the set
// (each file checked as this rank's own was, and of the same run), to be re-sharded. The
// other ranks' files must be readable here: one host, or a shared file system.
std::vector<std::vector<std::uint8_t>> sharded_states_of(const std::string& dir, long latest,
                                                         int written, const CheckpointFile& own) {
  std::vector<std::vector<std::uint8_t>> states;
  for (int j = 0; j < written; ++j) {
    const std::string path = rank_file(dir, latest, j);
    CheckpointFile f = decode_checkpoint(read_file(path), "checkpoint " + path);
    if (f.identity != own.identity || f.steps_done != own.steps_done) {
      throw std::runtime_error(path + " is not of the same run and step as this rank's file");
    }
    states.push_back(std::move(f.optimizer));
  }
  return states;
}

// This rank's part of a resume, alone: its file read and checked, then loaded into `state`.
Position load_own(const std::string& dir, const RankState& state, const RunShape& shape,
                  Report& report) {
  const long latest = latest_step(dir);
  const int world = state.ctx.size(), rank = state.ctx.rank();
  const std::string path = rank_file(dir, latest, rank);
  const std::string what = "checkpoint " + path;
  CheckpointFile f = decode_checkpoint(read_file(path), what);
  const int written = writers_of(f, world);
  try {
    if (written < world) {
      throw std::runtime_error("written by " + std::to_string(written) + " ranks; this run has " +
                               std::to_string(world) +
                               ": a checkpoint resumes on as many ranks or fewer");
    }
    if (const std::string why = identity_mismatches(f.identity, shape.identity(written));
        !why.empty()) {
      throw std::runtime_error(why);
    }
    check_position(f, latest, shape.bounds(written));
    std::size_t count = 0;
    for (const Parameter& p : state.model.parameters()) count += p.count;
    if (f.values.size() != count) {
      throw std::runtime_error(std::to_string(f.values.size()) + " weights; this model has " +
                               std::to_string(count));
    }
    check_finite(f.values, state.model);
    if (state.sharded) {
      state.sharded->load_values(f.values);
      if (written != world) {
        state.sharded->load_state_of_ranks(sharded_states_of(dir, latest, written, f));
      } else {
        state.sharded->load_state(f.optimizer);
      }
    } else {
      std::copy(f.values.begin(), f.values.end(), state.model.values().begin());
      state.optimizer->load_state(f.optimizer);
    }
    // A codec's residuals are what this rank held back: a rank of the smaller run keeps its
    // own, and the lost ranks' are dropped.
    if (state.reducer) state.reducer->load_state(f.reducer);
    if (state.scaler) state.scaler->load_state(f.scaler);
  } catch (const std::exception& e) {
    throw std::runtime_error(what + ": " + message_of(e));
  }
  Position at{static_cast<long>(f.steps_done), static_cast<int>(f.epoch),
              static_cast<std::size_t>(f.step)};
  if (written != world) at = rescale(at, written, world, shape.bounds(world));
  report.steps_done = at.steps_done;
  report.epoch = at.epoch;
  report.step = static_cast<std::int64_t>(at.step);
  report.written_by = written;
  report.values = fnv1a(bytes_of(std::span<const float>(f.values)));
  return at;
}

}  // namespace

// "GSTC" v4: u64 FNV-1a of every byte after it; the identity (u32 entries, each two strings:
// what and value); the position (i64 steps done, i64 epoch, i64 step); the model's values;
// the optimizer state, the reducer state and the loss scaler's. v3, read too, ends before the
// loss scaler.
std::vector<std::uint8_t> encode_checkpoint(const CheckpointFile& f) {
  gradsync::ByteWriter w("GSTC", kCheckpointFormat);
  w.put<std::uint64_t>(0);  // the checksum, once the contents are known
  w.put(static_cast<std::uint32_t>(f.identity.size()));
  for (const auto& [what, value] : f.identity) {
    w.string(what);
    w.string(value);
  }
  w.put(f.steps_done);
  w.put(f.epoch);
  w.put(f.step);
  w.floats(f.values);
  w.bytes(f.optimizer);
  w.bytes(f.reducer);
  w.bytes(f.scaler);
  std::vector<std::uint8_t> out = w.take();
  const std::uint64_t checksum = fnv1a(std::span(out).subspan(kContentsAt));
  std::memcpy(out.data() + kChecksumAt, &checksum, sizeof checksum);
  return out;
}

CheckpointFile decode_checkpoint(std::span<const std::uint8_t> bytes, const std::string& what) {
  const auto refuse = [&](const std::string& why) { throw std::runtime_error(what + ": " + why); };
  if (bytes.size() < kChecksumAt || std::memcmp(bytes.data(), "GSTC", 4) != 0) {
    refuse("not a gradsync-train checkpoint (no GSTC header)");
  }
  std::uint32_t version = 0;
  std::memcpy(&version, bytes.data() + kVersionAt, sizeof version);
  if (version != kCheckpointFormat && version != 3) {
    refuse("written by checkpoint format v" + std::to_string(version) +
           "; this build reads v3 and v" + std::to_string(kCheckpointFormat));
  }
  if (bytes.size() < kContentsAt) refuse("truncated: " + std::to_string(bytes.size()) + " bytes");
  std::uint64_t stored = 0;
  std::memcpy(&stored, bytes.data() + kChecksumAt, sizeof stored);
  if (fnv1a(bytes.subspan(kContentsAt)) != stored) {
    refuse("checksum mismatch: the file was damaged or changed after it was written");
  }
  try {
    gradsync::ByteReader in(bytes, "GSTC", version, what);
    in.get<std::uint64_t>();  // the checksum, checked above
    CheckpointFile f;
    const auto entries = in.get<std::uint32_t>();
    for (std::uint32_t i = 0; i < entries; ++i) {
      std::string key = in.string();
      f.identity.emplace_back(std::move(key), in.string());
    }
    f.steps_done = in.get<std::int64_t>();
    f.epoch = in.get<std::int64_t>();
    f.step = in.get<std::int64_t>();
    f.values = in.floats();
    const auto optimizer = in.bytes(), reducer = in.bytes();
    f.optimizer.assign(optimizer.begin(), optimizer.end());
    f.reducer.assign(reducer.begin(), reducer.end());
    if (version >= 4) {
      const auto scaler = in.bytes();
      f.scaler.assign(scaler.begin(), scaler.end());
    }
    in.finish();
    return f;
  } catch (const gradsync::Error& e) {
    throw std::runtime_error(e.detail());  // already names the file
  }
}

std::string cost_model_file(const std::string& dir) {
  return dir + "/COST_MODEL";
}

std::vector<std::uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path + ": " + std::strerror(errno));
  return std::vector<std::uint8_t>(std::istreambuf_iterator<char>(f), {});
}

void refuse_existing_checkpoints(gradsync::Context& ctx, const std::string& dir) {
  Report mine;
  std::error_code ec;
  std::size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    files += is_checkpoint_name(entry.path().filename().string());
  }
  if (files) {
    // Named the same on every rank (not by a rank's own file), so the ranks' reasons read as one.
    fail(mine, dir + " holds checkpoints of another run (" + std::to_string(files) + " files" +
                   (std::filesystem::exists(dir + "/LATEST") ? ", LATEST among them" : "") +
                   "), which this run would delete: continue them with --resume, or replace them "
                   "with --overwrite");
  }
  throw_if_any_failed(gather(ctx, mine), "refusing to start");
}

void save_checkpoint(const std::string& dir, const RankState& state, const Identity& identity,
                     const Position& at, int saves) {
  const int rank = state.ctx.rank();
  const std::string what = "checkpoint of step " + std::to_string(at.steps_done) + " not saved";
  Report mine;
  mine.steps_done = at.steps_done;
  mine.epoch = at.epoch;
  mine.step = static_cast<std::int64_t>(at.step);
  // Gathered by every rank together, before any can fail alone.
  const std::vector<float> gathered =
      state.sharded ? state.sharded->gather_values() : std::vector<float>();
  const std::span<const float> values =
      state.sharded ? std::span<const float>(gathered) : state.model.values();
  try {
    std::filesystem::create_directories(dir);
    // A run that diverged must not replace the last good set with weights no resume takes.
    check_finite(values, state.model);
    const char* crash = std::getenv("GRADSYNC_TRAIN_CRASH_AT_SAVE");  // tests only
    const bool crash_now = crash && rank == 0 && std::atoi(crash) == saves;
    write_atomically(rank_file(dir, at.steps_done, rank),
                     encode_checkpoint(snapshot(state, identity, at, values)), crash_now);
  } catch (const std::exception& e) {
    fail(mine, message_of(e));
  }
  // Every rank's file is complete, and of the same step, before LATEST names the step.
  const std::vector<Report> written = gather(state.ctx, mine);
  throw_if_any_failed(written, what + " (LATEST still names the previous one)");
  check_same_position(written, what);
  Report named;
  if (rank == 0) {
    try {
      name_latest(dir, state.ctx, at.steps_done);
    } catch (const std::exception& e) {
      fail(named, message_of(e));
    }
  }
  // Every rank knows LATEST names the new set before any removes its older files.
  throw_if_any_failed(gather(state.ctx, named), what + " (LATEST not updated)");
  remove_older_files(dir, rank, state.ctx.size(), at.steps_done);
}

Position load_checkpoint(const std::string& dir, const RankState& state, const RunShape& shape,
                         bool announce) {
  Report mine;
  mine.identity = identity_hash(shape.identity(state.ctx.size()));
  Position at;
  try {
    at = load_own(dir, state, shape, mine);
  } catch (const std::exception& e) {
    fail(mine, message_of(e));
  }
  // Every rank joins, whether its own load failed or not, so every rank fails alike.
  const std::vector<Report> all = gather(state.ctx, mine);
  const std::string what = "cannot resume from " + dir;
  throw_if_any_failed(all, what);
  check_same_position(all, what);
  if (const auto [odd, agreeing] = outliers(all, &Report::identity); !odd.empty()) {
    throw std::runtime_error(what + ": the flags of rank(s) " + odd + " differ from those of " +
                             agreeing);
  }
  // Every rank holds every weight (ZeRO gathers them after each step): a replica that differs
  // would train on apart.
  if (const auto [odd, agreeing] = outliers(all, &Report::values); !odd.empty()) {
    throw std::runtime_error(what + ": the weights rank(s) " + odd +
                             " loaded differ from those of rank(s) " + agreeing);
  }
  if (announce) {
    std::fprintf(stderr, "gradsync-train: resumed from %s at step %ld (epoch %d, step %zu)",
                 rank_file(dir, latest_step(dir), 0).c_str(), at.steps_done, at.epoch + 1, at.step);
    if (mine.written_by != state.ctx.size()) {
      std::fprintf(stderr, ", written by %d ranks, now %d", static_cast<int>(mine.written_by),
                   state.ctx.size());
    }
    std::fprintf(stderr, "\n");
  }
  return at;
}

}  // namespace train
