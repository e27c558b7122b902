// The launch environment: torchrun, mpirun, PMI and srun variables and the GRADSYNC_* knobs
// (core/knobs.h) resolved into Options.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "gradsync/gradsync.h"

namespace gradsync::env {

// GRADSYNC_TIMEOUT's default.
constexpr std::chrono::milliseconds kDefaultTimeout{300000};

std::optional<std::string> get(const char* name);
// The first variable of `names` that is set and parses as an integer; throws
// kInvalidArgument naming the variable if one is set to garbage.
std::optional<long long> first_int(const std::vector<const char*>& names);

// Fills every field of `options` left at its default from the environment (launcher
// conventions and GRADSYNC_* knobs), then from defaults, and validates the result: an explicit
// field beats the environment, which beats the default. Fields whose default depends on the
// transport (tcp_*, shm_*) stay unset (-1) when the environment does not set them either.
Options resolve(const Options& options);

}  // namespace gradsync::env
