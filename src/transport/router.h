// Routes each peer to the transport that reaches it (shm for ranks on this host, tcp for
// the rest), so the algorithms see one Transport for the whole world.
#pragma once

#include <memory>
#include <vector>

#include "transport/transport.h"

namespace gradsync::transport {

class RouterTransport final : public Transport {
 public:
  // `route[peer]` indexes `transports` (ignored for peer == rank).
  RouterTransport(int rank, int size, std::vector<std::unique_ptr<Transport>> transports,
                  std::vector<int> route);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "router"; }
  const char* name_for(int peer) const;

  RequestPtr isend(int peer, const Tag& tag, const void* data, std::size_t bytes) override;
  RequestPtr irecv(int peer, const Tag& tag, void* data, std::size_t bytes) override;
  RequestPtr irecv_consume(int peer, const Tag& tag, std::size_t bytes, Consumer consume) override;
  void abort(const std::string& reason) override;
  PeerTraffic traffic(int peer) const override;
  StallReport explain_stall(Clock::duration grace) override;
  const Transport* channel(int peer) const override;
  // The arena of the one transport every peer routes to, if it offers one for the whole world.
  SharedArena* shared_arena() override { return arena_; }
  // The least of the transports the peers route to.
  std::size_t buffered_send_bytes() const override;

 private:
  Transport& to(int peer) const;
  SharedArena* whole_world_arena() const;
  int rank_;
  int size_;
  std::vector<std::unique_ptr<Transport>> transports_;
  std::vector<int> route_;
  SharedArena* arena_ = nullptr;  // decided once: routes never change
};

}  // namespace gradsync::transport
