// Nothing left in /dev/shm however a rank ends, without gradsync-run to tidy up: SIGTERM,
// SIGINT or SIGHUP during the shm transport's setup unlinks the segments and ends the process
// with that signal; during rendezvous, mid-collective and after shutdown the process ends with
// the signal and leaves nothing; SIGKILL during setup leaves the segment only until the next job on
// the host sets up, or `gradsync-run --cleanup`; and the sweep keeps what is not provably stale.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <thread>

#include "gradsync/shm_segments.h"
#include "gradsync/store.h"
#include "harness.h"
#include "transport/shm.h"

namespace gradsync::transport {
namespace {

using namespace std::chrono_literals;
using testing::segments_left;

// Waits for `ready` to hold: a bound on a wait for an event, not a timing claim. False if it
// never did (the test then fails instead of hanging).
template <class Ready>
bool wait_for(Ready ready) {
  for (int i = 0; i < 6000; ++i) {
    if (ready()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

// A child process that sets up rank 0 of a 2-rank shm group whose rank 1 never comes: it
// creates its segment and waits in setup. Returns its pid once the segment exists.
pid_t start_lonely_setup(const std::string& prefix, const std::string& store_dir) {
  pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    auto store = make_file_store(store_dir);
    TransportOptions options;
    options.token = "sigtest-" + prefix;
    try {
      make_shm_transport(*store, prefix, 0, 2, testing::all_ranks(2), options, 600s);
    } catch (...) {
    }
    ::_exit(1);
  }
  EXPECT_TRUE(wait_for([&] { return !segments_left(prefix).empty(); }))
      << "the lonely rank never created its segment";
  return pid;
}

int status_of(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

TEST(ShmSignals, ATerminatingSignalDuringSetupUnlinksAndEndsTheProcessWithIt) {
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) {
    SCOPED_TRACE(::strsignal(sig));
    testing::TempDir dir;
    const std::string prefix = testing::unique_name("shm-signal");
    const pid_t pid = start_lonely_setup(prefix, dir.path());
    ::kill(pid, sig);
    const int status = status_of(pid);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == sig) << "status " << status;
    EXPECT_EQ(segments_left(prefix), std::vector<std::string>{});
  }
}

// A handler the program had is still called after the unlinking, and the program lives on if
// that handler says so (as CPython turns SIGINT into KeyboardInterrupt).
TEST(ShmSignals, TheProgramsOwnHandlerStillRuns) {
  testing::TempDir dir;
  const std::string prefix = testing::unique_name("shm-own-handler");
  const std::string marker = dir.path() + "/handled";
  pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    static std::string* handled_path = new std::string(marker);
    struct sigaction own {};
    own.sa_handler = [](int) {
      const int fd = ::open(handled_path->c_str(), O_CREAT | O_WRONLY, 0600);
      if (fd >= 0) ::close(fd);
    };
    ::sigaction(SIGTERM, &own, nullptr);
    auto store = make_file_store(dir.path());
    try {
      make_shm_transport(*store, prefix, 0, 2, testing::all_ranks(2), {}, 600s);
    } catch (...) {
    }
    ::_exit(1);
  }
  ASSERT_TRUE(wait_for([&] { return !segments_left(prefix).empty(); }));
  ::kill(pid, SIGTERM);
  EXPECT_TRUE(wait_for([&] { return std::filesystem::exists(marker); }));
  EXPECT_EQ(segments_left(prefix), std::vector<std::string>{});
  // Still alive, still waiting for rank 1: the handler did not end it.
  EXPECT_EQ(::waitpid(pid, nullptr, WNOHANG), 0);
  ::kill(pid, SIGKILL);
  status_of(pid);
}

struct HandJob {
  std::string token;
  int port;
  testing::TempDir logs;
  std::vector<pid_t> pids;

  explicit HandJob(const std::string& name) : token(name), port(testing::free_port()) {}
  pid_t start(int rank, int world_size, const std::string& mode) {
    pids.push_back(testing::start_worker_by_hand(mode, log(rank),
                                                 {{"RANK", std::to_string(rank)},
                                                  {"WORLD_SIZE", std::to_string(world_size)},
                                                  {"MASTER_ADDR", "127.0.0.1"},
                                                  {"MASTER_PORT", std::to_string(port)},
                                                  {"GRADSYNC_TOKEN", token},
                                                  {"GRADSYNC_TIMEOUT", "120000"}}));
    return pids.back();
  }
  std::string log(int rank) const { return logs.path() + "/rank" + std::to_string(rank) + ".log"; }
  std::vector<std::string> left() const { return segments_left(shm_segment_prefix(token)); }
};

// Rank 0 alone, waiting in rendezvous for rank 1 (its store is up): nothing made yet, and
// the signal ends it as it would any program.
TEST(ShmSignals, DuringRendezvousTheSignalEndsTheRank) {
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) {
    SCOPED_TRACE(::strsignal(sig));
    HandJob job(testing::unique_name("rdvz"));
    const pid_t pid = job.start(0, 2, "check");
    ASSERT_TRUE(wait_for([&] { return !testing::listening_address(job.port).empty(); }))
        << testing::read_file(job.log(0));
    ::kill(pid, sig);
    const int status = status_of(pid);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == sig)
        << "status " << status << ": " << testing::read_file(job.log(0));
    EXPECT_EQ(job.left(), std::vector<std::string>{});
  }
}

// Two ranks all-reducing over shared memory: the signalled one ends with its signal, the
// other fails naming the lost peer, and nothing is left (the names went once both had mapped
// them).
TEST(ShmSignals, MidCollectiveTheSignalEndsTheRankAndNothingIsLeft) {
  HandJob job(testing::unique_name("midcoll"));
  const pid_t first = job.start(0, 2, "loop");
  const pid_t second = job.start(1, 2, "loop");
  ASSERT_TRUE(wait_for([&] {
    return testing::contains(testing::read_file(job.log(0)), "looping") &&
           testing::contains(testing::read_file(job.log(1)), "looping");
  })) << testing::read_file(job.log(0))
      << testing::read_file(job.log(1));
  ::kill(first, SIGTERM);
  const int status = status_of(first);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << "status " << status;
  const int survivor = status_of(second);
  EXPECT_TRUE(WIFEXITED(survivor) && WEXITSTATUS(survivor) != 0) << "status " << survivor;
  EXPECT_TRUE(testing::contains(testing::read_file(job.log(1)), "rank 0"))
      << testing::read_file(job.log(1));
  EXPECT_EQ(job.left(), std::vector<std::string>{});
}

// After a group has set up, run and shut down (its transports destroyed, the handler long
// installed), the signal still ends the process with it, and there is nothing to leave.
TEST(ShmSignals, AfterShutdownTheSignalStillEndsTheProcess) {
  testing::TempDir dir;
  const std::string prefix = testing::unique_name("shm-after");
  const std::string marker = dir.path() + "/shut-down";
  pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    {
      auto store = make_inproc_store();
      testing::run_threads(2, [&](int rank) {
        make_shm_transport(*store, prefix, rank, 2, testing::all_ranks(2), {}, 60s);
      });
    }
    const int fd = ::open(marker.c_str(), O_CREAT | O_WRONLY, 0600);
    ::close(fd);
    for (;;) ::pause();
  }
  ASSERT_TRUE(wait_for([&] { return std::filesystem::exists(marker); }));
  ::kill(pid, SIGHUP);
  const int status = status_of(pid);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGHUP) << "status " << status;
  EXPECT_EQ(segments_left(prefix), std::vector<std::string>{});
}

// SIGKILL cannot be handled: the segment stays until the next job on the host sets up its
// shm transport (whatever its token), or until gradsync-run --cleanup.
TEST(ShmSignals, SigkillDuringSetupLeavesNothingPastTheNextJobOrACleanup) {
  for (bool cleanup : {false, true}) {
    SCOPED_TRACE(cleanup ? "gradsync-run --cleanup" : "the next job");
    testing::TempDir dir;
    const std::string prefix = testing::unique_name("shm-sigkill");
    const pid_t pid = start_lonely_setup(prefix, dir.path());
    ::kill(pid, SIGKILL);
    status_of(pid);
    // Tests running alongside set up transports too, whose sweep may remove it any time now.
    const std::vector<std::string> left = segments_left(prefix);
    EXPECT_LE(left.size(), 1u);
    if (cleanup) {
      const auto r = testing::run_shell(testing::build_dir() + "/tools/gradsync-run --cleanup");
      EXPECT_EQ(r.exit_code(), 0) << r.output;
      if (!left.empty() && !testing::contains(r.output, "removed /dev/shm/" + left[0])) {
        EXPECT_EQ(segments_left(prefix), std::vector<std::string>{}) << r.output;
      }
    } else {
      auto store = make_inproc_store();
      const std::string next = testing::unique_name("shm-next-job");
      testing::run_threads(2, [&](int rank) {
        make_shm_transport(*store, next, rank, 2, testing::all_ranks(2), {}, 60s);
      });
    }
    EXPECT_EQ(segments_left(prefix), std::vector<std::string>{});
  }
}

// The sweep removes only what it can prove stale: a transport's name whose creator is gone,
// made in this pid namespace (or before its creator said where). A segment from another pid
// namespace, one whose creator lives, and a name that is not a transport's all stay.
TEST(ShmSignals, TheSweepKeepsWhatIsNotProvablyStale) {
  pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  status_of(dead);
  const std::string tag = testing::unique_name("sweep");
  const auto make = [&](const std::string& name, std::uint64_t made_in) {
    const int fd = ::open(("/dev/shm/" + name).c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0) << name;
    EXPECT_EQ(::pwrite(fd, &made_in, sizeof made_in, kShmCreatorNamespaceOffset),
              static_cast<ssize_t>(sizeof made_in));
    ::close(fd);
  };
  struct stat own_ns {};
  ASSERT_EQ(::stat("/proc/self/ns/pid", &own_ns), 0);
  const std::string base = "gradsync-sweepabc-" + tag;
  const std::string here = base + "-here-p" + std::to_string(dead) + "-r0-0";
  const std::string unwritten = base + "-unwritten-p" + std::to_string(dead) + "-r0-0";
  const std::string elsewhere = base + "-elsewhere-p" + std::to_string(dead) + "-r0-0";
  const std::string alive = base + "-alive-p" + std::to_string(::getpid()) + "-r0-0";
  const std::string foreign = base + "-not-a-transport-name";
  make(here, own_ns.st_ino);
  make(unwritten, 0);
  make(elsewhere, own_ns.st_ino + 1);
  make(alive, own_ns.st_ino);
  make(foreign, own_ns.st_ino);
  // A sweep of a test running alongside may remove the stale two first: only what is left
  // afterwards is certain, and that the names reported are the stale ones.
  for (const std::string& name : remove_stale_shm_segments_of_every_job()) {
    if (testing::contains(name, tag)) {
      EXPECT_TRUE(name == here || name == unwritten) << name;
    }
  }
  std::vector<std::string> kept = segments_left(tag);
  std::sort(kept.begin(), kept.end());
  std::vector<std::string> want = {alive, elsewhere, foreign};
  std::sort(want.begin(), want.end());
  EXPECT_EQ(kept, want);
  for (const std::string& name : kept) ::unlink(("/dev/shm/" + name).c_str());
}

}  // namespace
}  // namespace gradsync::transport
