// Settings of the tcp transport that depend on the host and may be overridden by
// GRADSYNC_TCP_* environment variables: socket options and how long waiting callers poll.
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

// GRADSYNC_TCP_SOCKBUF_BYTES: SO_SNDBUF/SO_RCVBUF for every connection. 0 (default)
// leaves the kernel's autotuning on, which on Linux grows buffers past what a fixed
// setsockopt may (net.core.[rw]mem_max caps explicit sizes).
int socket_buffer_bytes() {
  static const int value = static_cast<int>(
      tuning_setting("GRADSYNC_TCP_SOCKBUF_BYTES", "0: kernel autotuning").value_or(0));
  return value;
}

// GRADSYNC_TCP_SPIN_US: how long a waiting caller keeps polling its sockets before it
// sleeps in poll(). Polling sees bytes without a wake-up, and a wake-up costs more than a
// small message (2-core VM, 4 KiB all-reduce: 2 ranks 29 us without polling, 11 us with
// it). When this host has a core for every local rank of the transport, it polls for
// kBusySpin; when ranks share cores, for kYieldSpin with sched_yield() between tries, so
// the ranks sharing the core run meanwhile (as Open MPI does when oversubscribed; 4 ranks
// on 2 cores: 69 -> 35 us). The variable overrides the duration; 0 turns polling off.
constexpr auto kBusySpin = std::chrono::microseconds(50);
constexpr auto kYieldSpin = std::chrono::microseconds(100);
long spin_us_setting() {
  static const long value =
      tuning_setting("GRADSYNC_TCP_SPIN_US", std::to_string(kBusySpin.count()) + ", or " +
                                                 std::to_string(kYieldSpin.count()) +
                                                 " yielding when ranks share cores")
          .value_or(-1);
  return value;
}

// GRADSYNC_TCP_LIVENESS_S: a peer whose host stops answering (link down, host powered off:
// no FIN or RST ever comes) is declared lost after about this many seconds, by the kernel:
// keepalive probes on an idle connection, TCP_USER_TIMEOUT on one with unacknowledged data.
// A peer that is only slow (computing, descheduled) still answers at the TCP level, so this
// does not fire for it. 0 turns it off (then only GRADSYNC_TIMEOUT ends such a wait).
int liveness_s() {
  static const int value =
      static_cast<int>(tuning_setting("GRADSYNC_TCP_LIVENESS_S", "15").value_or(15));
  return value;
}

void set_liveness(int fd) {
  const int limit = liveness_s();
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

void tune_socket(int fd) {
  net::set_nodelay(fd);
  set_liveness(fd);
  if (int b = socket_buffer_bytes(); b > 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &b, sizeof b);
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &b, sizeof b);
  }
}

SpinPolicy choose_spin(unsigned local_ranks) {
  SpinPolicy policy;
  policy.yield = local_ranks > usable_cores();
  long us = spin_us_setting();
  if (us >= 0) {
    policy.duration = std::chrono::microseconds(us);
  } else {
    policy.duration = policy.yield ? kYieldSpin : kBusySpin;
  }
  return policy;
}

}  // namespace gradsync::transport::tcp
