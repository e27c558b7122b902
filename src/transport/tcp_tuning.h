// Settings of the tcp transport that depend on the host and may be overridden through
// TcpOptions (from Options::tcp_*): socket options and how long waiting callers poll.
#pragma once

#include <chrono>

#include "transport/tcp.h"

// Hidden, as all tcp internals are (see tcp_core.h).
#pragma GCC visibility push(hidden)
namespace gradsync::transport::tcp {

// Applies TCP_NODELAY, liveness detection (tcp.liveness_s) and socket buffer sizes
// (tcp.socket_buffer_bytes) to a connection.
void tune_socket(int fd, const TcpOptions& tcp);

// How a waiting caller polls its sockets before it sleeps in poll() (TcpOptions::spin_us).
struct SpinPolicy {
  std::chrono::nanoseconds duration{0};  // 0: sleep at once
  bool yield = false;                    // sched_yield() between tries
};

// How long a waiter polls unless spin_us says: with a core of its own, and when ranks share
// cores (then yielding between tries). Why: see choose_spin in tcp_tuning.cc.
constexpr std::chrono::microseconds kBusySpin{50};
constexpr std::chrono::microseconds kYieldSpin{100};

// The policy for a transport with `local_ranks` ranks on this host (itself included);
// spin_us >= 0 sets the duration.
SpinPolicy choose_spin(unsigned local_ranks, int spin_us);

}  // namespace gradsync::transport::tcp
#pragma GCC visibility pop
