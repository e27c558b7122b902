// Settings of the tcp transport that depend on the host and may be overridden through
// TcpOptions (from Options::tcp_*): socket options and how long waiting callers poll.
#include "transport/tcp_tuning.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <string>

#include "rendezvous/socket.h"
#include "transport/transport.h"

namespace gradsync::transport::tcp {

namespace {

// Liveness: a peer whose host stops answering (link down, host powered off: no FIN or RST
// ever comes) is declared lost after about `limit` seconds, by the kernel: keepalive probes
// on an idle connection, TCP_USER_TIMEOUT on one with unacknowledged data. A peer that is
// only slow (computing, descheduled) still answers at the TCP level, so this does not fire
// for it. 0 turns it off (then only the context's timeout ends such a wait).
void set_liveness(int fd, int limit) {
  if (limit <= 0) return;
  int on = 1, idle = std::max(1, limit / 3), interval = 1, probes = std::max(1, limit - idle);
  unsigned user_timeout_ms = static_cast<unsigned>(limit) * 1000u;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof probes);
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof user_timeout_ms);
}

}  // namespace

// Socket buffers: 0 leaves the kernel's autotuning on, which on Linux grows buffers past
// what a fixed setsockopt may (net.core.[rw]mem_max caps explicit sizes).
void tune_socket(int fd, const TcpOptions& tcp) {
  net::set_nodelay(fd);
  set_liveness(fd, tcp.liveness_s);
  if (int b = tcp.socket_buffer_bytes; b > 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &b, sizeof b);
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &b, sizeof b);
  }
}

// Polling sees bytes without a wake-up, and a wake-up costs more than a small message's whole
// exchange (docs/performance-notes.md). When this host has a core for every local rank of the
// transport, a waiter polls for kBusySpin; when ranks share cores, for kYieldSpin with
// sched_yield() between tries, so the ranks sharing the core run meanwhile (as Open MPI does
// when oversubscribed).
SpinPolicy choose_spin(unsigned local_ranks, int spin_us) {
  SpinPolicy policy;
  policy.yield = local_ranks > usable_cores();
  if (spin_us >= 0) {
    policy.duration = std::chrono::microseconds(spin_us);
  } else {
    policy.duration = policy.yield ? kYieldSpin : kBusySpin;
  }
  return policy;
}

}  // namespace gradsync::transport::tcp
