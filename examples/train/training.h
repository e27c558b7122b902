// gradsync-train's training on one rank: the model, reducer and optimizer the flags ask for,
// the epochs of optimizer steps, the checkpoints, and the report at the end.
#pragma once

#include "train/flags.h"

namespace train {

// Trains as `c` says, as the rank of the job that gradsync::init() finds in the environment
// (gradsync-run sets it), and reports; returns the process's exit status. Errors throw.
int run_training(Config c);

}  // namespace train
