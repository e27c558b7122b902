// Environment knobs: every knob is read once, with a default, and logged (rank 0, once)
// when the environment overrides it (NCCL's NCCL_PARAM pattern).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "gradsync/gradsync.h"

namespace gradsync::env {

std::optional<std::string> get(const char* name);
// The first variable of `names` that is set and parses as an integer; throws
// kInvalidArgument naming the variable if one is set to garbage.
std::optional<long long> first_int(const std::vector<const char*>& names);

// Fills every field of `options` left at its default from the environment (torchrun,
// OpenMPI, MPICH/PMI and Slurm conventions), then from defaults, and validates the result.
Options resolve(const Options& options);

// Logs "gradsync: NAME=value (from environment)" on stderr, once per name per process.
void log_override(const char* name, const std::string& value);

}  // namespace gradsync::env
