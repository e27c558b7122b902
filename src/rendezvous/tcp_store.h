// The TCP store's settings beyond the public make_tcp_store_server/make_tcp_store: what
// init() knows about the job (its world size, who this rank is) so that the store can
// catch ranks started inconsistently, and the server's limits (tests shorten them).
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "gradsync/store.h"

namespace gradsync {

struct TcpStoreServerOptions {
  // The world size rank 0 was started with; every rank's hello must agree. 0: unknown (the
  // first rank to announce one sets it), and no bound on connections beyond kMaxUnknown.
  int world_size = 0;
  // A connection must authenticate within this long after it was accepted.
  std::chrono::milliseconds hello_timeout{10000};
  // Unauthenticated connections held at once; a new one evicts the oldest.
  std::size_t max_pending = 64;
  // Authenticated connections that are not ranks (tools, tests) beyond the world's ranks.
  std::size_t anonymous_slack = 8;
  // After the job failed, how long the server stays up at most so that ranks still
  // connected, or yet to say hello, learn why before it goes.
  std::chrono::milliseconds linger{5000};
};

std::unique_ptr<TcpStoreServer> make_tcp_store_server(const std::string& bind_addr, int port,
                                                      const std::string& token,
                                                      const TcpStoreServerOptions& options);

// Who a rank's store client announces itself as.
struct TcpStoreIdentity {
  int rank = -1;
  int world_size = -1;
};

// A client that announces `identity` (with this host's name and pid) in its hello.
std::shared_ptr<Store> make_tcp_store(const std::string& host, int port, const std::string& token,
                                      std::chrono::milliseconds connect_timeout,
                                      const TcpStoreIdentity& identity);

}  // namespace gradsync
