// The machine's ceilings that BENCHMARKS.md compares against, measured the same day:
// STREAM-style copy bandwidth (1 and 2 threads) and loopback TCP throughput between two
// processes. Prints one line per figure; medians of repeated runs.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// STREAM "copy" convention: bytes read + bytes written per second.
double copy_gbps(std::size_t bytes, int threads, int reps) {
  std::vector<std::vector<char>> src(threads), dst(threads);
  for (int t = 0; t < threads; ++t) {
    src[static_cast<std::size_t>(t)].assign(bytes, 1);
    dst[static_cast<std::size_t>(t)].assign(bytes, 0);
  }
  std::vector<double> results;
  for (int rep = 0; rep < reps; ++rep) {
    auto t0 = Clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        std::memcpy(dst[static_cast<std::size_t>(t)].data(), src[static_cast<std::size_t>(t)].data(), bytes);
      });
    }
    for (auto& th : pool) th.join();
    double s = std::chrono::duration<double>(Clock::now() - t0).count();
    results.push_back(2.0 * static_cast<double>(bytes) * threads / s / 1e9);
  }
  return median(results);
}

// One process streams `total` bytes to another over 127.0.0.1; payload bytes per second.
double loopback_tcp_gbps(std::size_t total) {
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(listener, 1) != 0 ||
      ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::perror("listen");
    std::exit(1);
  }
  pid_t child = ::fork();
  if (child == 0) {
    int s = ::socket(AF_INET, SOCK_STREAM, 0);
    if (::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) ::_exit(1);
    std::vector<char> buf(1 << 20, 7);
    std::size_t sent = 0;
    while (sent < total) {
      ssize_t n = ::send(s, buf.data(), std::min(buf.size(), total - sent), 0);
      if (n <= 0) ::_exit(1);
      sent += static_cast<std::size_t>(n);
    }
    ::close(s);
    ::_exit(0);
  }
  int s = ::accept(listener, nullptr, nullptr);
  std::vector<char> buf(1 << 20);
  std::size_t got = 0;
  auto t0 = Clock::now();
  while (got < total) {
    ssize_t n = ::recv(s, buf.data(), buf.size(), 0);
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  ::close(s);
  ::close(listener);
  ::waitpid(child, nullptr, 0);
  return static_cast<double>(got) / secs / 1e9;
}

}  // namespace

int main() {
  const std::size_t big = 256u << 20;
  std::printf("copy_bandwidth_1thread_gbps %.2f\n", copy_gbps(big, 1, 7));
  std::printf("copy_bandwidth_2threads_gbps %.2f\n", copy_gbps(big / 2, 2, 7));
  std::vector<double> tcp;
  for (int i = 0; i < 5; ++i) tcp.push_back(loopback_tcp_gbps(1u << 30));
  std::printf("loopback_tcp_gbps %.2f\n", median(tcp));
  return 0;
}
