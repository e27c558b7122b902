// gradsync-train's checkpoints: saving a rank's whole training state so a run killed at any
// point can resume and repeat, bit for bit, the losses of a run never interrupted.
//
// One file per rank (its optimizer shard and codec state are its own), each written to a
// temporary file, fsynced and renamed; then rank 0 names the step in LATEST the same way. A
// crash at any point leaves LATEST naming a complete earlier set.
#pragma once

#include <gradsync/gradsync.h>
#include <gradsync/optim.h>
#include <gradsync/reducer.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "train/model.h"

namespace train {

// Where training stands: the next step to run.
struct Position {
  long steps_done = 0;
  int epoch = 0;
  std::size_t step = 0;
};

// What a checkpoint holds of one rank besides the position. Without ZeRO the optimizer and
// the reducer (its codec's residuals) are set and `zero` is null; with ZeRO only `zero`.
struct RankState {
  gradsync::Context& ctx;
  Model& model;
  gradsync::optim::Optimizer* optimizer;
  gradsync::optim::ZeroOptimizer* zero;
  gradsync::Reducer* reducer;
};

// Saves `state` at `at` to `dir` and removes this rank's older files. Every rank calls it
// together (it waits for all ranks' files before LATEST names them). `saves` counts this
// run's saves from 1: GRADSYNC_TRAIN_CRASH_AT_SAVE=N (tests) aborts rank 0 in the middle of
// save N, after writing its temporary file and before renaming it.
void save_checkpoint(const std::string& dir, const RankState& state, const Position& at, int saves);

// Restores `state` from the set dir/LATEST names and returns where that run stood; with
// `announce`, says so on stderr. A file that is not a checkpoint, is truncated, or was written
// by another number of ranks or another model size throws std::runtime_error naming it.
Position load_checkpoint(const std::string& dir, const RankState& state, bool announce);

// The cost model a checkpoint's run chose its algorithms with (see save_checkpoint): a
// resumed run that measured the machine again could choose others, whose float32 sums round
// differently.
std::string cost_model_file(const std::string& dir);

// The whole file; one that cannot be opened throws std::runtime_error naming it.
std::vector<std::uint8_t> read_file(const std::string& path);

}  // namespace train
