// The registry of gradsync's environment variables (knobs), after NCCL's NCCL_PARAM: each
// GRADSYNC_* variable, and each launcher variable init() reads (RANK, WORLD_SIZE, ... and their
// mpirun, PMI and srun names), has one row here, with its default, what it accepts, and the
// Options field that sets it per context. Code reads the variables only through these
// functions, so every read is validated the same way and logged once, and README's tables can
// be checked against the rows (tests/knobs_test.cc).
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "gradsync/error.h"

namespace gradsync::knobs {

// When a knob is read. Per context: by init(), once for each context, because an Options
// field can set it instead (and a process may make several contexts). Per process: once, at
// first use, by the code that needs it (there is one set of kernels, one timeline, one log).
// Launcher: like per context, but set by the launcher (torchrun, mpirun, PMI, srun,
// gradsync-run) rather than the user, and never logged (every rank of every job sets them).
enum class Scope { kContext, kProcess, kLauncher };

// The largest world init() accepts: far beyond any job, small enough that a rank or a count of
// ranks fits every int the library computes with.
inline constexpr long long kMaxWorldSize = 1 << 20;

struct Knob {
  std::string_view name;          // GRADSYNC_...
  std::string_view default_text;  // what applies when it is unset, as README shows it
  std::string_view accepts;       // what a value may be; reads after "is not"
  // Scope::kContext: the Options field that takes precedence over the variable. Otherwise why
  // there is none, and the API that does the same where there is one.
  std::string_view setter;
  std::string_view meaning;  // one line
  Scope scope;
  bool logged = true;  // false for secrets (a log line would copy them into job logs) and
                       // for the launcher's variables
  // Integer knobs: the values integer() accepts, which `accepts` states as "in [min, max]".
  // Both 0 for text knobs.
  long long min = 0, max = 0;
};

// Every row, sorted by name.
std::span<const Knob> all();
// The row of `name`; an unregistered name is a programming error (std::logic_error).
const Knob& find(std::string_view name);

// The value of variable `name`, nullopt when it is unset or empty (the way launchers clear
// a variable). The first read that finds it set logs it (see log_override).
std::optional<std::string> text(std::string_view name);
// The value of another library's variable (UCX_TLS, ...), nullopt when unset or empty: read so
// that a transport can honour what the user told that library, but neither registered nor
// logged here, since gradsync neither owns nor documents it. One of gradsync's own names is a
// programming error (std::logic_error): those go through text().
std::optional<std::string> foreign_text(std::string_view name);
// The value as an integer in the row's [min, max]; anything else (garbage, a sign or space
// around it, out of range, past long long) is refused (see refusal). A row without a range is
// a programming error (std::logic_error).
std::optional<long long> integer(std::string_view name);

// The error for a value of `name` it does not accept:
// "NAME='value' is not <accepts>[: detail]", kInvalidArgument.
Error refusal(std::string_view name, const std::string& value, const std::string& detail = "");

// Logs "gradsync: NAME=value (from environment; default D)" on stderr, once per name per
// process, on rank 0 only (RANK unset or 0), unless GRADSYNC_QUIET is set.
void log_override(std::string_view name, const std::string& value);

}  // namespace gradsync::knobs
