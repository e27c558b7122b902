// TCP transport for ranks on any host: one connection per peer, non-blocking sockets
// driven by one epoll thread, TCP_NODELAY, token handshake, framed messages.
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
};

// Collective call over the ranks in `group` (global ranks, sorted, including `rank`).
// Publishes this rank's listening address in `store` under `key_prefix`, connects to
// every peer (lower rank dials higher), checks the job token both ways.
std::unique_ptr<Transport> make_tcp_transport(Store& store, const std::string& key_prefix, int rank,
                                              int world_size, const std::vector<int>& group,
                                              const TransportOptions& options,
                                              const TcpOptions& tcp,
                                              std::chrono::milliseconds timeout);

}  // namespace gradsync::transport
