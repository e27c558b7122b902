// A TCP port for a store that another process (rank 0, torch's TCPStore) will bind, chosen
// outside the kernel's ephemeral range. Header-only, so that gradsync-run (which links nothing
// of the library) and the tests choose ports the same way.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <random>

namespace gradsync::net {

namespace unused_port_detail {

// Whether nothing holds `port` on any address now. No SO_REUSEADDR: a port with connections
// still in TIME_WAIT counts as taken too.
inline bool bindable(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

inline int kernel_choice() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof addr;
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

}  // namespace unused_port_detail

// A port free now that no other process is likely to take before the store binds it. The
// kernel's own choice (bind to port 0) comes from the ephemeral range, which every outgoing
// connection and every listener on port 0 draws from as well: on a busy host (a test suite
// starting ranks in parallel) one of them took such a port between the choice and rank 0's
// bind. Ports outside that range are taken only by processes that name them, so a random one
// that binds now stays free. Falls back to the kernel's choice where the range leaves no room;
// -1 if no socket can be made.
inline int pick_unused_port() {
  int ephemeral_low = 32768, ephemeral_high = 60999;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> ephemeral_low >> ephemeral_high;
  // Below 10000 live the well-known services a host may start later (databases, web servers).
  constexpr int kLowest = 10000, kHighest = 65535;
  const int below = std::max(0, ephemeral_low - kLowest);
  const int above = std::max(0, kHighest - ephemeral_high);
  if (below + above > 0) {
    std::mt19937 random(std::random_device{}());
    std::uniform_int_distribution<int> pick(0, below + above - 1);
    for (int attempt = 0; attempt < 64; ++attempt) {
      const int k = pick(random);
      const int port = k < below ? kLowest + k : ephemeral_high + 1 + (k - below);
      if (unused_port_detail::bindable(port)) return port;
    }
  }
  return unused_port_detail::kernel_choice();
}

}  // namespace gradsync::net
