// The launch environment: torchrun, mpirun, PMI and srun variables and the GRADSYNC_* knobs
// (core/knobs.h) resolved into Options.
#pragma once

#include <chrono>

#include "gradsync/gradsync.h"

namespace gradsync::env {

// GRADSYNC_TIMEOUT's default.
constexpr std::chrono::milliseconds kDefaultTimeout{300000};

// Fills every field of `options` left at its default from the environment (launcher
// conventions and GRADSYNC_* knobs, all read through the registry, core/knobs.h), then from
// defaults, and validates the result: an explicit field beats the environment, which beats the
// default. A value out of range is refused naming the variable (or field) that set it. Fields whose
// default depends on the transport (tcp_*, shm_*) stay unset (-1) when the environment does not set
// them either.
Options resolve(const Options& options);

}  // namespace gradsync::env
