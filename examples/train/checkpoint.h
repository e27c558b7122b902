// gradsync-train's checkpoints: saving a rank's whole training state so a run killed at any
// point can resume and repeat, bit for bit, the losses of a run never interrupted.
//
// One file per rank (its optimizer shard and codec state are its own), each written to a
// temporary file, fsynced and renamed; once every rank reports its file complete, rank 0 names
// the step in LATEST the same way, and only once every rank knows LATEST names the new set
// does any rank remove its older files. A crash or a failed write at any point leaves LATEST
// naming a complete earlier set, whose files are all still there.
//
// Each file carries its format version, a checksum of everything after it, and the identity
// of the run that wrote it (the flags the state depends on), so a resume refuses, naming the
// cause, a damaged file or one of another run before it decodes anything.
#pragma once

#include <gradsync/gradsync.h>
#include <gradsync/optim.h>
#include <gradsync/reducer.h>
#include <gradsync/sharded.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "train/model.h"

namespace train {

// Where training stands: the next step to run.
struct Position {
  long steps_done = 0;
  int epoch = 0;
  std::size_t step = 0;
};

// What a resumed run must share with the run that wrote the checkpoint, each as how the user
// sets it and its value: {"--codec", "topk:ratio=0.01"}, {"gradsync-run -n", "3"}.
using Identity = std::vector<std::pair<std::string, std::string>>;

// Where a resumed run can stand: `epochs` epochs (its --epochs) of `steps_per_epoch` steps.
struct Bounds {
  int epochs = 0;
  std::size_t steps_per_epoch = 0;
};

// This run's identity and bounds as they would read at `world` ranks: a checkpoint written by
// another number of ranks (gradsync-run --min-ranks shrank the job) is checked against the
// flags this run would have had at that size, since the schedule's length in steps and the
// scaled learning rate follow the ranks.
struct RunShape {
  std::function<Identity(int world)> identity;
  std::function<Bounds(int world)> bounds;
};

// What a checkpoint holds of one rank besides the position: the model's values, whole (with
// ZeRO gathered from the shards), and the state of the optimizer and the reducer (its codec's
// residuals), or of the sharded engine, whichever the run has (the others null).
struct RankState {
  gradsync::Context& ctx;
  Model& model;
  gradsync::optim::Optimizer* optimizer;
  gradsync::Reducer* reducer;
  gradsync::ShardedDataParallel* sharded;
  gradsync::optim::LossScaler* scaler;  // --amp fp16
};

// One rank's file, decoded. The position is signed as stored, so a damaged one is seen as such.
struct CheckpointFile {
  Identity identity;
  std::int64_t steps_done = 0, epoch = 0, step = 0;
  std::vector<float> values;
  std::vector<std::uint8_t> optimizer, reducer;
  std::vector<std::uint8_t> scaler;  // empty without one (and in format 3)
};

// The format this build writes and reads.
inline constexpr std::uint32_t kCheckpointFormat = 4;

// A file's bytes, checksum included.
std::vector<std::uint8_t> encode_checkpoint(const CheckpointFile& file);

// Throws std::runtime_error "<what>: <why>" for bytes that are not a whole checkpoint of
// kCheckpointFormat whose checksum matches its contents; nothing is decoded before the check.
CheckpointFile decode_checkpoint(std::span<const std::uint8_t> bytes, const std::string& what);

// Every rank calls it together, before training, in a run that neither resumes nor
// overwrites: throws on every rank when `dir` (on any rank) holds checkpoints, which this run
// did not write and would delete.
void refuse_existing_checkpoints(gradsync::Context& ctx, const std::string& dir);

// Saves `state` at `at` to `dir` and removes this rank's older files once every rank knows
// LATEST names the new set. Every rank calls it together; a rank that cannot write makes
// every rank throw, leaving the previous set named and whole. `saves` counts this run's
// saves from 1: GRADSYNC_TRAIN_CRASH_AT_SAVE=N (tests) aborts rank 0 in the middle of save N,
// after writing its temporary file and before renaming it.
void save_checkpoint(const std::string& dir, const RankState& state, const Identity& identity,
                     const Position& at, int saves);

// Restores `state` from the set dir/LATEST names and returns where that run stood; with
// `announce`, says so on stderr. Every rank calls it together. Each rank checks its file
// (LATEST, format, checksum, identity, position within its bounds, finite weights), then all
// compare what they loaded (the same position, identity and weights, bit for bit); if anything
// fails on any rank, every rank throws the same std::runtime_error naming each cause.
//
// A set written by W ranks where this run has N < W (gradsync-run --min-ranks): rank r reads
// its own file (data parallelism keeps every replica's weights and optimizer state equal, and
// its codec's residuals are its own; the lost ranks' are dropped) and starts at the same
// epoch, at the step where the samples the W ranks had taken end. ZeRO's sharded optimizer
// state is re-sharded from every rank's file (ShardedDataParallel::load_state_of_ranks), which
// must then be readable by every rank. Refused: N > W.
Position load_checkpoint(const std::string& dir, const RankState& state, const RunShape& shape,
                         bool announce);

// The cost model a checkpoint's run chose its algorithms with (see save_checkpoint): a
// resumed run that measured the machine again could choose others, whose float32 sums round
// differently.
std::string cost_model_file(const std::string& dir);

// The whole file; one that cannot be opened throws std::runtime_error naming it.
std::vector<std::uint8_t> read_file(const std::string& path);

}  // namespace train
