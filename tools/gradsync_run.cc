// gradsync-run: starts the ranks of a job on this host (like torchrun / mpirun), gives each
// its rendezvous environment, prefixes its output, and tears the whole job down when a rank fails.
//
// Deliberately independent of the gradsync library: a launcher that cannot start because the
// library is broken would hide the very failures it exists to report.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

// Header-only, so the launcher still links nothing of the library; by path, as this target
// has no include directories.
#include "flag_numbers.h"
#include "gradsync/shm_segments.h"
#include "gradsync/version.h"
#include "launcher_rendezvous.h"
#include "rendezvous/unused_port.h"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kUsage =
    "usage: gradsync-run [options] [--] prog [args...]\n"
    "       gradsync-run --cleanup\n"
    "\n"
    "Starts N ranks of `prog` on this host and sets in each: RANK, WORLD_SIZE, LOCAL_RANK,\n"
    "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, GRADSYNC_TOKEN.\n"
    "\n"
    "options:\n"
    "  -n, --nproc-per-node N  ranks on this host (default 1)\n"
    "  --nnodes M              hosts in the job (default 1)\n"
    "  --node-rank K           index of this host, 0..M-1 (default 0);\n"
    "                          RANK = K*N + LOCAL_RANK, WORLD_SIZE = M*N\n"
    "  --master-addr A         host of rank 0's rendezvous store (default 127.0.0.1)\n"
    "  --master-port P         its port (default: a free port on one host, 29500 on several)\n"
    "  --timeout-s S           stop the job (exit 124) if it runs longer than S seconds\n"
    "  --grace-s S             seconds between SIGTERM and SIGKILL when stopping (default 3)\n"
    "  --max-restarts N        when a rank fails, stop the others and start every rank again,\n"
    "                          up to N times (default 0); each attempt's ranks see\n"
    "                          GRADSYNC_RESTART_COUNT (0, 1, ...), so a program can resume\n"
    "                          from its checkpoint (gradsync-train --checkpoint does). On\n"
    "                          several hosts the launchers restart together through a\n"
    "                          rendezvous that host 0's launcher holds on --master-port (the\n"
    "                          ranks' store then takes the next ports, one per attempt); a\n"
    "                          host whose launcher stops answering for GRADSYNC_TCP_LIVENESS_S\n"
    "                          seconds (default 15) is lost, which fails the attempt too\n"
    "  --min-ranks M           with --max-restarts on one host: take a failed rank's slot as\n"
    "                          lost (its device) and restart with one rank fewer, as long as\n"
    "                          at least M remain (elastic shrink: WORLD_SIZE drops, and\n"
    "                          gradsync-train resumes its checkpoint at the smaller size)\n"
    "  --min-nodes M           with --max-restarts on several hosts: go on without lost hosts\n"
    "                          as long as at least M remain (default: every host is needed)\n"
    "  --no-prefix             do not prefix output lines with \"[rank R] \"\n"
    "  --cleanup               remove from /dev/shm the segments of any gradsync job of this\n"
    "                          user whose creating process is gone (a rank killed by SIGKILL\n"
    "                          while setting up), print their names, and exit\n"
    "  --version               the version of gradsync, and exit\n"
    "  -h, --help              this text\n"
    "\n"
    "GRADSYNC_TOKEN, the secret every connection of the job presents, is taken from the\n"
    "environment if set, otherwise 128 random bits on one host. A job on several hosts needs\n"
    "the same token on every host: export GRADSYNC_TOKEN=<same value> everywhere (for example\n"
    "`openssl rand -hex 16`). Without it the token is derived from master addr and port, which\n"
    "anyone who can guess them can reproduce; gradsync-run warns when it does that.\n"
    "\n"
    "When a rank exits non-zero or dies of a signal, the others get SIGTERM, then SIGKILL after\n"
    "the grace period; gradsync-run names the first failed rank and exits with its code (or\n"
    "128+signal). SIGINT/SIGTERM/SIGHUP are forwarded to every rank; the exit code is then\n"
    "128+signal. Ranks read stdin from /dev/null. Afterwards /dev/shm/gradsync-<first 8 chars\n"
    "of the token>* is removed in case a rank died before unlinking its shared memory.\n";

struct Config {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = -1;  // -1: choose (see kUsage)
  double timeout_s = 0;  // 0: no job timeout
  double grace_s = 3;    // long enough for a rank to flush logs and unlink shm on SIGTERM
  int max_restarts = 0;
  int min_ranks = 0;  // 0: restarts keep the size
  int min_nodes = 0;  // 0: every host is needed
  bool prefix = true;
  std::vector<std::string> command;
};

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "gradsync-run: %s\n(run gradsync-run --help for usage)\n", msg.c_str());
  std::exit(2);
}

// The most ranks a job may have: gradsync's limit on WORLD_SIZE (README's launcher table).
constexpr long long kMaxWorldSize = 1 << 20;
// About three years: a limit a duration<double> converts to steady_clock's nanoseconds without
// overflow.
constexpr double kMaxSeconds = 1e8;

long parse_int(const std::string& flag, const std::string& value, long lo, long hi) {
  return static_cast<long>(gradsync::flags::integer(flag, value, lo, hi, usage_error));
}

double parse_seconds(const std::string& flag, const std::string& value) {
  return gradsync::flags::number(flag, value, 0, kMaxSeconds, false, usage_error);
}

Config parse_args(int argc, char** argv) {
  Config cfg;
  int i = 1;
  // Accepts "--flag value" and "--flag=value"; the first non-option word starts the command.
  auto take_value = [&](const std::string& arg, const std::string& flag, std::string* out) -> bool {
    if (arg == flag) {
      if (i + 1 >= argc) usage_error(flag + " needs a value");
      *out = argv[++i];
      return true;
    }
    if (arg.size() > flag.size() && arg.compare(0, flag.size(), flag) == 0 &&
        arg[flag.size()] == '=') {
      *out = arg.substr(flag.size() + 1);
      return true;
    }
    return false;
  };
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    std::string v;
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (arg == "--version") {
      std::printf("gradsync-run %s\n", GRADSYNC_VERSION_STRING);
      std::exit(0);
    } else if (arg == "--cleanup") {
      if (argc != 2) usage_error("--cleanup takes no other option or command");
      for (const std::string& name : gradsync::remove_stale_shm_segments_of_every_job()) {
        std::printf("removed /dev/shm/%s\n", name.c_str());
      }
      std::exit(0);
    } else if (take_value(arg, "-n", &v) || take_value(arg, "--nproc-per-node", &v)) {
      cfg.nproc_per_node = static_cast<int>(parse_int("--nproc-per-node", v, 1, 4096));
    } else if (take_value(arg, "--nnodes", &v)) {
      cfg.nnodes = static_cast<int>(parse_int("--nnodes", v, 1, kMaxWorldSize));
    } else if (take_value(arg, "--node-rank", &v)) {
      cfg.node_rank = static_cast<int>(parse_int("--node-rank", v, 0, kMaxWorldSize - 1));
    } else if (take_value(arg, "--master-addr", &v)) {
      if (v.empty()) usage_error("--master-addr must not be empty");
      cfg.master_addr = v;
    } else if (take_value(arg, "--master-port", &v)) {
      cfg.master_port = static_cast<int>(parse_int("--master-port", v, 1, 65535));
    } else if (take_value(arg, "--timeout-s", &v)) {
      cfg.timeout_s = parse_seconds("--timeout-s", v);
    } else if (take_value(arg, "--grace-s", &v)) {
      cfg.grace_s = parse_seconds("--grace-s", v);
    } else if (take_value(arg, "--max-restarts", &v)) {
      cfg.max_restarts = static_cast<int>(parse_int("--max-restarts", v, 0, 1000));
    } else if (take_value(arg, "--min-ranks", &v)) {
      cfg.min_ranks = static_cast<int>(parse_int("--min-ranks", v, 1, 4096));
    } else if (take_value(arg, "--min-nodes", &v)) {
      cfg.min_nodes = static_cast<int>(parse_int("--min-nodes", v, 1, kMaxWorldSize));
    } else if (arg == "--no-prefix") {
      cfg.prefix = false;
    } else if (!arg.empty() && arg[0] == '-') {
      usage_error("unknown option '" + arg + "'");
    } else {
      break;
    }
  }
  for (; i < argc; ++i) cfg.command.emplace_back(argv[i]);
  if (cfg.command.empty()) usage_error("no program to run");
  if (const long long ranks = static_cast<long long>(cfg.nnodes) * cfg.nproc_per_node;
      ranks > kMaxWorldSize) {
    usage_error("--nnodes " + std::to_string(cfg.nnodes) + " x --nproc-per-node " +
                std::to_string(cfg.nproc_per_node) + " is " + std::to_string(ranks) +
                " ranks, more than the " + std::to_string(kMaxWorldSize) + " a job may have");
  }
  if ((cfg.min_ranks > 0 || cfg.min_nodes > 0) && cfg.max_restarts == 0) {
    usage_error(std::string(cfg.min_ranks > 0 ? "--min-ranks" : "--min-nodes") +
                " shrinks the job when it restarts: give --max-restarts too");
  }
  if (cfg.min_ranks > 0 && cfg.nnodes > 1) {
    usage_error(
        "--min-ranks is for one host; on several, --min-nodes says how many hosts "
        "the job may shrink to");
  }
  if (cfg.min_nodes > cfg.nnodes) {
    usage_error("--min-nodes " + std::to_string(cfg.min_nodes) + " is more than --nnodes " +
                std::to_string(cfg.nnodes));
  }
  if (cfg.min_ranks > cfg.nproc_per_node) {
    usage_error("--min-ranks " + std::to_string(cfg.min_ranks) + " is more than the " +
                std::to_string(cfg.nproc_per_node) + " ranks the job starts with");
  }
  if (cfg.node_rank >= cfg.nnodes) {
    usage_error("--node-rank " + std::to_string(cfg.node_rank) + " must be below --nnodes " +
                std::to_string(cfg.nnodes));
  }
  return cfg;
}

// --- job identity ---------------------------------------------------------------------------

// The documented fallback for jobs on several hosts: every host computes the same value from
// the same flags without talking to the others. Two FNV-1a 64-bit hashes with different
// offsets make 128 bits; this is an identifier, not a secret.
std::string derived_token(const std::string& addr, int port) {
  std::string text = "gradsync:" + addr + ":" + std::to_string(port);
  unsigned char bytes[16];
  std::uint64_t seeds[2] = {0xcbf29ce484222325ull, 0x84222325cbf29ce4ull};
  for (int h = 0; h < 2; ++h) {
    std::uint64_t x = seeds[h];
    for (unsigned char c : text) {
      x ^= c;
      x *= 0x100000001b3ull;
    }
    for (int b = 0; b < 8; ++b) bytes[h * 8 + b] = static_cast<unsigned char>(x >> (56 - 8 * b));
  }
  return gradsync_run::hex(bytes, sizeof bytes);
}

// --- signals --------------------------------------------------------------------------------

// Self-pipe: handlers only write the signal number, the poll loop does the work. This keeps
// the handlers async-signal-safe and lets one poll() wait for output, exits and signals.
int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  int saved = errno;
  unsigned char b = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &b, 1);
  errno = saved;
}

constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGHUP};

void install_handlers() {
  if (::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    std::perror("gradsync-run: pipe2");
    std::exit(1);
  }
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : kForwardedSignals) ::sigaction(sig, &sa, nullptr);
  sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  ::sigaction(SIGCHLD, &sa, nullptr);
  // A closed stdout (gradsync-run ... | head) must not kill the launcher and orphan the ranks.
  ::signal(SIGPIPE, SIG_IGN);
}

std::string describe_signal(int sig) {
  const char* name = ::strsignal(sig);
  return "signal " + std::to_string(sig) + " (" + (name ? name : "unknown") + ")";
}

// --- ranks ----------------------------------------------------------------------------------

// One output stream of one rank: bytes not yet ending in a newline wait in `partial`.
struct Stream {
  int fd = -1;   // read end of the rank's pipe; -1 once closed
  int out = -1;  // 1 or 2: where the launcher writes the rank's lines
  std::string partial;
};

struct Rank {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;  // wait status once !running
  Stream streams[2];
};

void write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // reader went away: drop output rather than stall the job
    data.remove_prefix(static_cast<std::size_t>(n));
  }
}

class OutputRelay {
 public:
  explicit OutputRelay(bool prefix) : prefix_(prefix) {}

  // Emits every complete line of `s`; a line longer than kMaxLine is cut so that a rank
  // printing without newlines (progress bars) cannot grow the launcher without bound.
  void feed(const Rank& r, Stream& s, std::string_view data) {
    s.partial.append(data);
    std::size_t start = 0;
    for (;;) {
      std::size_t nl = s.partial.find('\n', start);
      if (nl == std::string::npos) break;
      emit(r, s, std::string_view(s.partial).substr(start, nl - start));
      start = nl + 1;
    }
    s.partial.erase(0, start);
    if (s.partial.size() >= kMaxLine) {
      emit(r, s, s.partial);
      s.partial.clear();
    }
  }

  // At end of stream a last line without newline still gets its prefix and a newline, so
  // the next rank's line does not run into it.
  void flush(const Rank& r, Stream& s) {
    if (!s.partial.empty()) emit(r, s, s.partial);
    s.partial.clear();
  }

 private:
  static constexpr std::size_t kMaxLine = 64 * 1024;

  void emit(const Rank& r, const Stream& s, std::string_view line) {
    // One write per line keeps lines whole even when stdout and stderr share a terminal.
    line_.clear();
    if (prefix_) line_ += "[rank " + std::to_string(r.rank) + "] ";
    line_.append(line);
    line_ += '\n';
    write_all(s.out, line_);
  }

  bool prefix_;
  std::string line_;
};

// Reads what `s` has now. Returns false at end of stream (then `s` is closed).
bool pump(OutputRelay& relay, Rank& r, Stream& s) {
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(s.fd, buf, sizeof buf);
    if (n > 0) {
      relay.feed(r, s, std::string_view(buf, static_cast<std::size_t>(n)));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    relay.flush(r, s);  // EOF, or an error that will not go away
    ::close(s.fd);
    s.fd = -1;
    return false;
  }
}

std::vector<std::string> child_environment(const Config& cfg, int local_rank,
                                           const std::string& token, int restart) {
  const std::pair<const char*, std::string> ours[] = {
      {"GRADSYNC_RESTART_COUNT", std::to_string(restart)},
      {"RANK", std::to_string(cfg.node_rank * cfg.nproc_per_node + local_rank)},
      {"WORLD_SIZE", std::to_string(cfg.nnodes * cfg.nproc_per_node)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(cfg.nproc_per_node)},
      {"MASTER_ADDR", cfg.master_addr},
      {"MASTER_PORT", std::to_string(cfg.master_port)},
      {"GRADSYNC_TOKEN", token},
  };
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string_view kv(*e);
    bool replaced = false;
    for (const auto& [key, value] : ours) {
      std::size_t len = std::strlen(key);
      if (kv.size() > len && kv.compare(0, len, key) == 0 && kv[len] == '=') replaced = true;
    }
    if (!replaced) env.emplace_back(kv);
  }
  for (const auto& [key, value] : ours) env.push_back(std::string(key) + "=" + value);
  return env;
}

// fork + exec one rank. Its stdout/stderr go to pipes (or are inherited with --no-prefix);
// it leads its own process group so that stopping it also stops whatever it spawned
// (a shell script's children would otherwise keep running and hold the pipes open).
void spawn(const Config& cfg, Rank& r, int local_rank, const std::string& token, int restart) {
  int pipes[2][2] = {{-1, -1}, {-1, -1}};
  if (cfg.prefix) {
    for (auto& p : pipes) {
      if (::pipe2(p, O_CLOEXEC) != 0) {
        std::perror("gradsync-run: pipe2");
        std::exit(1);
      }
    }
  }
  // Built before fork: the child must only call async-signal-safe functions before exec.
  std::vector<std::string> env = child_environment(cfg, local_rank, token, restart);
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<char*> argv;
  for (const auto& a : cfg.command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);

  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t launcher = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) {
    std::perror("gradsync-run: fork");
    std::exit(1);
  }
  if (pid == 0) {
    ::setpgid(0, 0);
    // If the launcher itself is killed (kill -9, OOM), its ranks must not run on unsupervised.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != launcher) ::_exit(1);  // it died before prctl took effect
    // Undo the launcher's signal setup: ignored dispositions and masks survive exec.
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    for (int sig : kForwardedSignals) ::sigaction(sig, &dfl, nullptr);
    ::sigaction(SIGCHLD, &dfl, nullptr);
    ::sigaction(SIGPIPE, &dfl, nullptr);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    // Ranks are in a background process group: reading the terminal would stop them.
    int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (devnull >= 0) ::dup2(devnull, 0);
    if (cfg.prefix) {
      ::dup2(pipes[0][1], 1);
      ::dup2(pipes[1][1], 2);
    }
    ::execvpe(argv[0], argv.data(), envp.data());
    const char* what = std::strerror(errno);
    const char* pre = "gradsync-run: cannot execute '";
    [[maybe_unused]] ssize_t n = ::write(2, pre, std::strlen(pre));
    n = ::write(2, argv[0], std::strlen(argv[0]));
    n = ::write(2, "': ", 3);
    n = ::write(2, what, std::strlen(what));
    n = ::write(2, "\n", 1);
    ::_exit(127);  // the shell's "command not found" code
  }
  // Also set from the parent so a signal sent right after fork reaches the group.
  ::setpgid(pid, pid);
  r.pid = pid;
  r.running = true;
  if (cfg.prefix) {
    for (int k = 0; k < 2; ++k) {
      ::close(pipes[k][1]);
      ::fcntl(pipes[k][0], F_SETFL, ::fcntl(pipes[k][0], F_GETFL) | O_NONBLOCK);
      r.streams[k].fd = pipes[k][0];
      r.streams[k].out = k + 1;
    }
  }
}

// Sends `sig` to the rank's process group, falling back to the rank alone if the group is
// already gone.
void signal_rank(const Rank& r, int sig) {
  if (::kill(-r.pid, sig) != 0 && errno == ESRCH && r.running) ::kill(r.pid, sig);
}

bool failed(int status) {
  return !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

std::string describe_exit(const Rank& r) {
  std::string who = "rank " + std::to_string(r.rank) + " (pid " + std::to_string(r.pid) + ")";
  if (WIFSIGNALED(r.status)) return who + " was killed by " + describe_signal(WTERMSIG(r.status));
  return who + " exited with code " + std::to_string(WEXITSTATUS(r.status));
}

int exit_code_of(int status) {
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

// How one start of every rank ended: the first rank that failed, or the signal or timeout
// that made the launcher stop them (none of these: every rank exited 0).
struct Outcome {
  std::optional<Rank> first_failure;
  int launcher_signal = 0;  // a signal that made the launcher stop the job
  bool timed_out = false;
  bool told_to_stop = false;  // by the rendezvous of the launchers of several hosts
  int stopped = 0;            // ranks still running when the job was first told to stop
};

// Starts every rank of this host, relays their output, and waits for all of them: stopping the
// others (SIGTERM, then SIGKILL after the grace period) once one fails, the launcher gets a
// signal, the job passes --timeout-s since `start`, or `control_fd` (-1: none) is readable and
// `told_to_stop` says so.
Outcome run_ranks(const Config& cfg, const std::string& token, int restart, Clock::time_point start,
                  int control_fd = -1, const std::function<bool()>& told_to_stop = {}) {
  Outcome outcome;
  std::vector<Rank> ranks(static_cast<std::size_t>(cfg.nproc_per_node));
  for (int l = 0; l < cfg.nproc_per_node; ++l) {
    Rank& r = ranks[static_cast<std::size_t>(l)];
    r.rank = cfg.node_rank * cfg.nproc_per_node + l;
    spawn(cfg, r, l, token, restart);
  }

  OutputRelay relay(cfg.prefix);
  std::optional<Clock::time_point> kill_at;  // set once stopping: when SIGKILL follows SIGTERM
  const Rank* first_failure = nullptr;
  int& launcher_signal = outcome.launcher_signal;
  bool& timed_out = outcome.timed_out;
  int running = cfg.nproc_per_node;
  int& stopped = outcome.stopped;

  auto stop_all = [&](int sig) {
    for (const Rank& r : ranks) {
      if (r.running) signal_rank(r, sig);
    }
    if (!kill_at) {
      stopped = running;
      kill_at = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(cfg.grace_s));
    }
  };

  while (running > 0) {
    std::vector<pollfd> fds{{g_signal_pipe[0], POLLIN, 0}, {control_fd, POLLIN, 0}};
    std::vector<std::pair<Rank*, Stream*>> owners{{nullptr, nullptr}, {nullptr, nullptr}};
    for (Rank& r : ranks) {
      for (Stream& s : r.streams) {
        if (s.fd >= 0) {
          fds.push_back({s.fd, POLLIN, 0});
          owners.emplace_back(&r, &s);
        }
      }
    }
    // SIGCHLD wakes the poll; the cap only bounds how late a deadline can be noticed.
    int wait_ms = 1000;
    auto now = Clock::now();
    auto clamp_to = [&](Clock::time_point t) {
      auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t - now).count() + 1;
      wait_ms = static_cast<int>(std::max<long long>(0, std::min<long long>(wait_ms, ms)));
    };
    if (kill_at) clamp_to(*kill_at);
    if (cfg.timeout_s > 0 && !kill_at) {
      clamp_to(start + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(cfg.timeout_s)));
    }
    int n = ::poll(fds.data(), fds.size(), wait_ms);
    if (n < 0 && errno != EINTR) {
      std::perror("gradsync-run: poll");
      stop_all(SIGKILL);
    }

    // Output first, so a rank's last words come out before the report of its exit.
    for (std::size_t k = 2; n > 0 && k < fds.size(); ++k) {
      if (fds[k].revents) pump(relay, *owners[k].first, *owners[k].second);
    }

    unsigned char sigs[64];
    ssize_t got;
    while ((got = ::read(g_signal_pipe[0], sigs, sizeof sigs)) > 0) {
      for (ssize_t k = 0; k < got; ++k) {
        int sig = sigs[k];
        if (sig == SIGCHLD) continue;  // reaped below
        if (launcher_signal || first_failure || timed_out) {
          stop_all(SIGKILL);  // a second interrupt means "now"
        } else {
          launcher_signal = sig;
          stop_all(sig);
        }
      }
    }

    // Among ranks reaped together, one killed by a signal is more likely the cause than one
    // that exited with an error after seeing its peer vanish.
    const Rank* batch_failure = nullptr;
    int status = 0;
    pid_t pid;
    while ((pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
      for (Rank& r : ranks) {
        if (r.pid != pid || !r.running) continue;
        r.running = false;
        r.status = status;
        --running;
        if (failed(status) &&
            (!batch_failure || (WIFSIGNALED(status) && !WIFSIGNALED(batch_failure->status)))) {
          batch_failure = &r;
        }
      }
    }
    if (batch_failure && !first_failure && !launcher_signal && !timed_out &&
        !outcome.told_to_stop) {
      first_failure = batch_failure;
      stop_all(SIGTERM);
    }
    // After the ranks reaped: where a rank of this host died as another host's failure stopped
    // the job (both seen by one poll), this host's own failure is the one it names.
    if (fds[1].revents && control_fd >= 0 && !outcome.told_to_stop && told_to_stop()) {
      outcome.told_to_stop = true;
      control_fd = -1;
      if (!kill_at) stop_all(SIGTERM);
    }

    now = Clock::now();
    if (cfg.timeout_s > 0 && !kill_at &&
        now - start >= std::chrono::duration<double>(cfg.timeout_s)) {
      timed_out = true;
      stop_all(SIGTERM);
    }
    if (kill_at && now >= *kill_at) stop_all(SIGKILL);
  }

  // Every rank has exited; take what is left in the pipes without waiting for writers that
  // outlived their rank.
  for (Rank& r : ranks) {
    for (Stream& s : r.streams) {
      if (s.fd >= 0 && pump(relay, r, s)) {
        relay.flush(r, s);
        ::close(s.fd);
        s.fd = -1;
      }
    }
  }
  if (kill_at) {
    // The job was stopped: processes the ranks spawned must not outlive it.
    for (const Rank& r : ranks) ::kill(-r.pid, SIGKILL);
  }
  gradsync::remove_stale_shm_segments(token);
  if (first_failure) outcome.first_failure = *first_failure;
  return outcome;
}

// The launcher's own report of how the job ended, and its exit code.
int report(const Config& cfg, const Outcome& outcome) {
  if (outcome.first_failure) {
    std::fprintf(stderr, "gradsync-run: %s", describe_exit(*outcome.first_failure).c_str());
    if (outcome.stopped > 0) std::fprintf(stderr, "; stopped %d other rank(s)", outcome.stopped);
    std::fprintf(stderr, "\n");
    return exit_code_of(outcome.first_failure->status);
  }
  if (outcome.launcher_signal) {
    std::fprintf(stderr, "gradsync-run: received %s; stopped %d rank(s)\n",
                 describe_signal(outcome.launcher_signal).c_str(), outcome.stopped);
    return 128 + outcome.launcher_signal;
  }
  if (outcome.timed_out) {
    std::fprintf(stderr, "gradsync-run: job exceeded --timeout-s %g; stopped %d rank(s)\n",
                 cfg.timeout_s, outcome.stopped);
    return 124;  // as timeout(1)
  }
  return 0;
}

// GRADSYNC_TCP_LIVENESS_S as the library reads it: how long a silent host may take to be
// declared lost.
int liveness_seconds() {
  const char* v = std::getenv("GRADSYNC_TCP_LIVENESS_S");
  if (!v || !*v) return 15;
  return static_cast<int>(parse_int("GRADSYNC_TCP_LIVENESS_S", v, 0, 86400));
}

// --max-restarts on several hosts: every attempt is a round of the launchers' rendezvous
// (launcher_rendezvous.h), which host 0's launcher holds. The ranks of round R meet at
// --master-port + 1 + R, so that a rank left over from an earlier round cannot join a later one.
int run_across_hosts(Config cfg, const std::string& token, Clock::time_point start) {
  gradsync_run::RendezvousSettings settings;
  settings.nnodes = cfg.nnodes;
  settings.min_nodes = cfg.min_nodes > 0 ? cfg.min_nodes : cfg.nnodes;
  settings.max_restarts = cfg.max_restarts;
  settings.liveness_s = liveness_seconds();
  // Stopping ranks takes up to twice the grace period; a host slower than that and its
  // liveness to come back is taken as lost.
  settings.rejoin_s = 2 * cfg.grace_s + settings.liveness_s + 10;
  // As long as torchrun's rendezvous waits for its first round (15 minutes), within the job's
  // own limit.
  settings.join_s = cfg.timeout_s > 0 ? std::min(cfg.timeout_s, 900.0) : 900.0;
  settings.token = token;
  std::unique_ptr<gradsync_run::RendezvousServer> server;
  if (cfg.node_rank == 0) {
    server = std::make_unique<gradsync_run::RendezvousServer>(settings, cfg.master_port);
  }
  gradsync_run::RendezvousClient rendezvous(cfg.master_addr, cfg.master_port, cfg.node_rank,
                                            settings);
  using Kind = gradsync_run::Message::Kind;
  const int store_port = cfg.master_port + 1;
  for (int round = 0;; ++round) {
    rendezvous.ready(round);
    gradsync_run::Message m = rendezvous.next();
    if (m.kind == Kind::kStart) {
      Config attempt = cfg;
      attempt.node_rank = m.node_index;
      attempt.nnodes = m.nnodes;
      attempt.master_port = store_port + m.round;
      round = m.round;
      if (round > 0) {
        std::fprintf(stderr, "gradsync-run: restart %d of %d: %d host(s), %d ranks\n", round,
                     cfg.max_restarts, m.nnodes, m.nnodes * cfg.nproc_per_node);
      }
      std::optional<gradsync_run::Message> told;
      Outcome outcome;
      if (rendezvous.has_buffered_message()) {
        told = rendezvous.next();  // stopped as it started: came with the START
      } else {
        outcome = run_ranks(attempt, token, round, start, rendezvous.fd(), [&] {
          told = rendezvous.next();
          return true;
        });
      }
      if (!told && (outcome.launcher_signal || outcome.timed_out)) {
        const int code = report(attempt, outcome);
        rendezvous.abort(code, outcome.timed_out
                                   ? "the job exceeded --timeout-s"
                                   : describe_signal(outcome.launcher_signal) + " to a launcher");
        return code;
      }
      if (!told) {
        if (outcome.first_failure) {
          // Named here too: another host's failure may reach the rendezvous first (a rank
          // that lost this one), and then its STOP names that one.
          std::fprintf(stderr, "gradsync-run: %s\n", describe_exit(*outcome.first_failure).c_str());
          rendezvous.failed(round, exit_code_of(outcome.first_failure->status),
                            describe_exit(*outcome.first_failure));
        } else {
          rendezvous.done(round);
        }
        told = rendezvous.next();
      } else if (outcome.first_failure) {
        // Stopped for another host's failure (its STOP names it) after a rank here failed.
        std::fprintf(stderr, "gradsync-run: %s\n", describe_exit(*outcome.first_failure).c_str());
      }
      m = *told;
    }
    if (m.kind == Kind::kStop) {
      std::fprintf(stderr, "gradsync-run: %s; restarting every rank\n", m.text.c_str());
      continue;
    }
    if (m.kind == Kind::kEnd) {
      if (m.code != 0) std::fprintf(stderr, "gradsync-run: %s\n", m.text.c_str());
      return m.code;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg = parse_args(argc, argv);

  const char* env_token = std::getenv("GRADSYNC_TOKEN");
  const bool port_given = cfg.master_port >= 0;
  if (cfg.master_port < 0) {
    // One host: any free port avoids clashes between jobs. Several hosts: every host must
    // agree without talking, so the conventional default.
    cfg.master_port = cfg.nnodes == 1 ? gradsync::net::pick_unused_port() : 29500;
    if (cfg.master_port < 0) {
      std::fprintf(stderr, "gradsync-run: cannot find a free port: %s\n", std::strerror(errno));
      return 1;
    }
  }
  std::string token;
  if (env_token && *env_token) {
    token = env_token;
  } else if (cfg.nnodes == 1) {
    token = gradsync_run::random_hex(16);  // 128 bits: unguessable, and readable in logs
  } else {
    token = derived_token(cfg.master_addr, cfg.master_port);
    std::fprintf(stderr,
                 "gradsync-run: warning: GRADSYNC_TOKEN is not set; using a token derived from "
                 "%s:%d, which anyone who knows that address can reproduce. Export the same "
                 "random GRADSYNC_TOKEN on every host.\n",
                 cfg.master_addr.c_str(), cfg.master_port);
  }

  install_handlers();
  const auto start = Clock::now();
  if (cfg.nnodes > 1 && cfg.max_restarts > 0) return run_across_hosts(cfg, token, start);
  for (int restart = 0;; ++restart) {
    const Outcome outcome = run_ranks(cfg, token, restart, start);
    const bool restartable = outcome.first_failure && !outcome.launcher_signal &&
                             !outcome.timed_out && restart < cfg.max_restarts;
    if (restartable && cfg.min_ranks > 0 && cfg.nproc_per_node - 1 < cfg.min_ranks) {
      std::fprintf(stderr,
                   "gradsync-run: %s; not restarting: %d rank(s) would be fewer than --min-ranks "
                   "%d\n",
                   describe_exit(*outcome.first_failure).c_str(), cfg.nproc_per_node - 1,
                   cfg.min_ranks);
    } else if (restartable) {
      // The failed rank's slot is lost; the survivors' slots are renumbered 0..N-2.
      if (cfg.min_ranks > 0) --cfg.nproc_per_node;
      std::fprintf(stderr, "gradsync-run: %s; restarting every rank (restart %d of %d, %d ranks)\n",
                   describe_exit(*outcome.first_failure).c_str(), restart + 1, cfg.max_restarts,
                   cfg.nproc_per_node);
      // The ranks' store starts afresh: on one host, on a port nobody holds.
      if (cfg.nnodes == 1 && !port_given) cfg.master_port = gradsync::net::pick_unused_port();
      continue;
    }
    return report(cfg, outcome);
  }
}
