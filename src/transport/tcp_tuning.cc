// Settings of the tcp transport that depend on the host and may be overridden through
// TcpOptions (from Options::tcp_*): socket options and how long waiting callers poll.
#include "transport/tcp_tuning.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <string>

#include "rendezvous/liveness.h"
#include "rendezvous/socket.h"
#include "transport/transport.h"

namespace gradsync::transport::tcp {

// Socket buffers: 0 leaves the kernel's autotuning on, which on Linux grows buffers past
// what a fixed setsockopt may (net.core.[rw]mem_max caps explicit sizes).
void tune_socket(int fd, const TcpOptions& tcp) {
  net::set_nodelay(fd);
  net::set_liveness(fd, tcp.liveness_s);
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
