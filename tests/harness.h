// The test harness: run N ranks as threads of this process (fast grids over the inproc
// transport) or as forked processes (real shm/tcp transports, crashes, kill -9).
#pragma once

#include <gtest/gtest.h>
#include <sys/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gradsync/error.h"
#include "gradsync/gradsync.h"
#include "transport/shm_layout.h"
#include "transport/tcp_buffer_pool.h"
#include "transport/transport.h"

namespace gradsync::testing {

// Runs fn(rank) on `n` threads and joins them; rethrows the first exception after all
// threads have finished (so a failing rank cannot leave others running).
void run_threads(int n, const std::function<void(int rank)>& fn);

// Builds `n` inproc transports of one group and runs fn(rank, transport) on n threads.
void run_inproc_transports(int n, const std::function<void(int, transport::Transport&)>& fn);

// Builds `n` contexts over the inproc transport and runs fn(ctx) on n threads.
void run_inproc_contexts(int n, const std::function<void(Context&)>& fn, Options options = {});

// Builds `n` contexts over the shared-memory transport (threads of this process meeting
// through an in-process store) and runs fn(ctx) on n threads: what the inproc contexts do,
// plus the shared arena that shared-memory algorithms need.
void run_shm_contexts(int n, const std::function<void(Context&)>& fn, Options options = {});

// Forks `n` processes; child `rank` runs fn(rank) and exits with its return value (an
// uncaught exception prints its message and exits 3). Returns each child's wait status,
// killing any child still alive after `timeout_s`.
std::vector<int> run_processes(int n, const std::function<int(int rank)>& fn, int timeout_s = 60);

// A fresh directory under /tmp, removed with its contents on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A collective_worker (tests/collective_worker.cc) in `mode`, started as mpirun or a user
// would start it: with `env` (RANK, WORLD_SIZE, MASTER_ADDR, ...) and without the test's own
// GRADSYNC_TOKEN, its output to `log`. It dies with this process; the caller reaps it.
pid_t start_worker_by_hand(const std::string& mode, const std::string& log,
                           const std::map<std::string, std::string>& env);

// A TCP port free now, outside the kernel's ephemeral range (rendezvous/unused_port.h).
int free_port();

// The local address of the socket listening on `port`, as /proc/net/tcp writes it (hex), or
// "" while there is none.
std::string listening_address(int port);

// Names in /dev/shm that contain `part`: must stay empty whatever happens to the ranks.
std::vector<std::string> segments_left(const std::string& part);

// A job-unique prefix for store keys and shm names, so parallel tests do not collide.
std::string unique_name(const std::string& base);

// The build directory (tests run from build/tests) and the source tree (scripts/).
std::string build_dir();
std::string source_dir();

// Runs a shell command, capturing stdout and stderr together; status as from waitpid.
struct ShellResult {
  int status = -1;
  std::string output;
  int exit_code() const;  // -1 unless it exited normally
};
ShellResult run_shell(const std::string& cmd);

// Occurrences of `part` in `s`.
int count_of(const std::string& s, const std::string& part);

// A file's whole contents ("" if it cannot be read, e.g. not written yet).
std::string read_file(const std::string& path);

// The "losses" array of a gradsync-train --json file, as printed: each the shortest text that
// reads back as the same float, so equal text means equal bits.
std::vector<std::string> losses_of(const std::string& json_path);

// Ranks 0..n-1: the group of a world that is all on one host.
std::vector<int> all_ranks(int n);

// A message larger than any buffer a transport keeps (shm's inbox, tcp's pooled buffers), and
// not a whole number of pages: one that cannot complete before the receiver takes it.
inline constexpr std::size_t kBeyondEveryTransportBuffer =
    std::max(transport::shm::kInboxBudgetBytes, transport::tcp::BufferPool::kMaxCachedBytes) +
    (std::size_t{1} << 20) + 12;

// ThreadSanitizer runs the threaded parts (Makefile, sanitize-tsan). A test whose threads are all
// those of another test, differing from it only in single-threaded code (parsing, the trainer's
// arithmetic), skips itself there, naming the test that runs its threads.
#if defined(__SANITIZE_THREAD__)
#define GRADSYNC_SKIP_UNDER_TSAN(threads_tested_by) \
  GTEST_SKIP() << "under ThreadSanitizer its threads are " << (threads_tested_by) << "'s"
#else
#define GRADSYNC_SKIP_UNDER_TSAN(threads_tested_by) static_cast<void>(threads_tested_by)
#endif

// The transports the process tests run over: shm, tcp, and ucx where this build has it.
inline std::vector<std::string> process_transports() {
  std::vector<std::string> names = {"shm", "tcp"};
  if (GRADSYNC_HAVE_UCX) names.emplace_back("ucx");
  return names;
}

inline bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Runs `fn`, which must throw gradsync::Error of `kind`; returns the error for more checks.
template <class Fn>
Error expect_error(ErrorKind kind, Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    return e;
  }
  ADD_FAILURE() << "expected gradsync::Error(" << to_string(kind) << "), nothing was thrown";
  return Error(kind, "(not thrown)");
}

}  // namespace gradsync::testing
