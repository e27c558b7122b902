// Settings of the tcp transport that depend on the host and may be overridden by
// GRADSYNC_TCP_* environment variables: socket options and how long waiting callers poll.
#pragma once

#include <chrono>

// Hidden, as all tcp internals are (see tcp_core.h).
#pragma GCC visibility push(hidden)
namespace gradsync::transport::tcp {

// Applies TCP_NODELAY, liveness detection (GRADSYNC_TCP_LIVENESS_S) and socket buffer sizes
// (GRADSYNC_TCP_SOCKBUF_BYTES) to a connection.
void tune_socket(int fd);

// How a waiting caller polls its sockets before it sleeps in poll() (GRADSYNC_TCP_SPIN_US).
struct SpinPolicy {
  std::chrono::nanoseconds duration{0};  // 0: sleep at once
  bool yield = false;                    // sched_yield() between tries
};

// The policy for a transport with `local_ranks` ranks on this host (itself included).
SpinPolicy choose_spin(unsigned local_ranks);

}  // namespace gradsync::transport::tcp
#pragma GCC visibility pop
