// Liveness of a TCP connection, header-only so that gradsync-run (which links nothing of the
// library) sets it as the tcp transport does.
#pragma once

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>

namespace gradsync::net {

// A peer whose host stops answering (link down, host powered off: no FIN or RST ever comes)
// is declared lost after about `limit` seconds, by the kernel: keepalive probes on an idle
// connection, TCP_USER_TIMEOUT on one with unacknowledged data. A peer that is only slow
// (computing, descheduled) still answers at the TCP level, so this does not fire for it. 0
// turns it off.
inline void set_liveness(int fd, int limit) {
  if (limit <= 0) return;
  int on = 1, idle = std::max(1, limit / 3), interval = 1, probes = std::max(1, limit - idle);
  unsigned user_timeout_ms = static_cast<unsigned>(limit) * 1000u;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof probes);
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof user_timeout_ms);
}

}  // namespace gradsync::net
