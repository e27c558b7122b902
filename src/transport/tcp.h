// TCP transport for ranks on any host: one connection per peer, non-blocking sockets
// progressed by waiting callers and one epoll thread, TCP_NODELAY, token handshake, framed
// messages.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "gradsync/store.h"
#include "transport/transport.h"

namespace gradsync::transport {

struct TcpOptions {
  std::string bind_addr = "0.0.0.0";  // address to listen on
  std::string advertise_addr;         // address peers dial; default: this host's address
  // Tuning, from Options::tcp_* (see tcp_tuning.cc for why these defaults).
  int liveness_s = 15;          // a peer whose host stops answering is lost after this; 0: never
  int socket_buffer_bytes = 0;  // SO_SNDBUF and SO_RCVBUF; 0: the kernel's autotuning
  int spin_us = -1;             // how long a waiter polls before poll(); -1: see choose_spin
};

// Collective call over the ranks in `group` (global ranks, sorted, including `rank`).
// Publishes this rank's listening address in `store` under `key_prefix` + "/tcp/<rank>",
// connects to every peer (lower rank dials higher), checks the job token both ways; strays
// on the listening port (wrong token, garbage) are refused without failing the setup.
// The transport's rank()/size() are `rank`/`world_size` and peers are named by global
// rank; a rank outside `group` is kInvalidArgument. traffic() counts payload bytes and
// messages of data frames only (48-byte headers and handshake/abort frames excluded);
// received traffic is counted when a waiting caller or the epoll thread has read a whole
// message, even before it is matched.
// Throws kTimeout naming the missing peers (and host:port) if setup exceeds `timeout`.
std::unique_ptr<Transport> make_tcp_transport(Store& store, const std::string& key_prefix, int rank,
                                              int world_size, const std::vector<int>& group,
                                              const TransportOptions& options,
                                              const TcpOptions& tcp,
                                              std::chrono::milliseconds timeout);

}  // namespace gradsync::transport
