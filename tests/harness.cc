// Thread and process runners shared by every test.
#include "harness.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>
#include <thread>

#include "rendezvous/socket.h"
#include "rendezvous/unused_port.h"
#include "transport/inproc.h"

namespace gradsync::testing {

void run_threads(int n, const std::function<void(int rank)>& fn) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

void run_inproc_transports(int n, const std::function<void(int, transport::Transport&)>& fn) {
  auto group = transport::make_inproc_group(n);
  std::vector<std::unique_ptr<transport::Transport>> ts;
  for (int r = 0; r < n; ++r) ts.push_back(transport::make_inproc_transport(group, r));
  run_threads(n, [&](int r) { fn(r, *ts[static_cast<std::size_t>(r)]); });
}

std::vector<int> run_processes(int n, const std::function<int(int rank)>& fn, int timeout_s) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    pid_t pid = ::fork();
    if (pid == 0) {
      int code = 3;
      try {
        code = fn(r);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
      }
      std::fflush(stdout);
      std::fflush(stderr);
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  std::vector<int> status(static_cast<std::size_t>(n), -1);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  int remaining = n;
  while (remaining > 0) {
    for (int r = 0; r < n; ++r) {
      auto i = static_cast<std::size_t>(r);
      if (status[i] != -1) continue;
      int st = 0;
      if (::waitpid(pids[i], &st, WNOHANG) == pids[i]) {
        status[i] = st;
        --remaining;
      }
    }
    if (remaining == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < n; ++r) {
        if (status[static_cast<std::size_t>(r)] == -1)
          ::kill(pids[static_cast<std::size_t>(r)], SIGKILL);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return status;
}

TempDir::TempDir() {
  char tmpl[] = "/tmp/gradsync-test-XXXXXX";
  char* p = ::mkdtemp(tmpl);
  if (!p) std::abort();
  path_ = p;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

pid_t start_worker_by_hand(const std::string& mode, const std::string& log,
                           const std::map<std::string, std::string>& env) {
  const std::string worker = build_dir() + "/tests/collective_worker";
  pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    std::freopen(log.c_str(), "w", stdout);
    std::freopen(log.c_str(), "a", stderr);
    ::unsetenv("GRADSYNC_TOKEN");
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    ::execl(worker.c_str(), worker.c_str(), mode.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return pid;
}

int free_port() {
  return net::pick_unused_port();
}

std::string listening_address(int port) {
  char want[16];
  std::snprintf(want, sizeof want, ":%04X ", port);
  std::istringstream lines(read_file("/proc/net/tcp"));
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream fields(line);
    std::string slot, local, remote, state;
    fields >> slot >> local >> remote >> state;
    if (state == "0A" && (local + " ").find(want) != std::string::npos) {
      return local.substr(0, local.find(':'));
    }
  }
  return {};
}

std::vector<std::string> segments_left(const std::string& part) {
  std::vector<std::string> left;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    std::string name = entry.path().filename().string();
    if (name.find(part) != std::string::npos) left.push_back(name);
  }
  return left;
}

std::string unique_name(const std::string& base) {
  static std::atomic<int> counter{0};
  return base + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
}

std::string build_dir() {
  auto exe = std::filesystem::read_symlink("/proc/self/exe");
  return exe.parent_path().parent_path().string();
}

std::string source_dir() {
  return GRADSYNC_SOURCE_DIR;
}

int ShellResult::exit_code() const {
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

ShellResult run_shell(const std::string& cmd) {
  ShellResult r;
  std::fflush(stdout);
  std::fflush(stderr);
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  std::size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, got);
  r.status = ::pclose(p);
  return r;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::string> losses_of(const std::string& json_path) {
  const std::string text = read_file(json_path);
  const auto open = text.find("\"losses\": [");
  if (open == std::string::npos) return {};
  const auto close = text.find(']', open);
  std::vector<std::string> out;
  std::stringstream in(text.substr(open + 11, close - open - 11));
  for (std::string item; std::getline(in, item, ',');) {
    out.push_back(item.substr(item.find_first_not_of(' ')));
  }
  return out;
}

std::vector<int> all_ranks(int n) {
  std::vector<int> group(static_cast<std::size_t>(n));
  std::iota(group.begin(), group.end(), 0);
  return group;
}

int count_of(const std::string& s, const std::string& part) {
  int n = 0;
  for (std::size_t pos = s.find(part); pos != std::string::npos; pos = s.find(part, pos + 1)) ++n;
  return n;
}

}  // namespace gradsync::testing
