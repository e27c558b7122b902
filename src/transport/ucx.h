// UCX transport: messages through UCX's tag-matching interface, so that whatever UCX finds
// (InfiniBand or RoCE with registered memory and zero-copy rendezvous, its own shared memory,
// TCP) carries them. Which devices and transports UCX uses is UCX's own configuration
// (UCX_TLS, UCX_NET_DEVICES, ...), read from the environment like any UCX program's.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gradsync/store.h"
#include "transport/transport.h"

namespace gradsync::transport {

struct UcxOptions {
  // UCX settings applied on top of the environment's (name without the UCX_ prefix, value),
  // e.g. {"TLS", "tcp"}: how tests give each transport of one process its own.
  std::vector<std::pair<std::string, std::string>> config;
  int spin_us = -1;  // how long a waiter polls before it sleeps; -1: as the tcp transport
};

// The settings make_ucx_transport applies: `config`, then what the transport adds where neither
// `config` nor the environment (`environment_value`: the value of UCX_<name>, if set) sets
// it. Where UCX may use TCP alone (UCX_TLS names only tcp, and perhaps self), RNDV_THRESH=inf:
// there the rendezvous protocol costs a round trip per message and its zero-copy has no
// hardware to use, while eager messages stream (BENCHMARKS.md, the ucx transport across hosts).
std::vector<std::pair<std::string, std::string>> ucx_settings(
    const UcxOptions& ucx,
    const std::function<std::optional<std::string>(const std::string& name)>& environment_value);

// Collective call over the ranks in `group` (global ranks, sorted, including `rank`).
// Publishes this rank's UCX worker address in `store` under `key_prefix` + "/ucx/<rank>"
// (the store proves the job token, so only the job's ranks learn the addresses), connects
// to every peer and returns once every peer has answered a hello. A lost peer is noticed by
// UCX's peer-failure handling (kPeerLost); an abort reaches every peer as a message.
// traffic() counts payload bytes and messages (not the 48-byte header each carries).
// Throws kTimeout naming the missing peers if setup exceeds `timeout`, kSystem if UCX is not
// installed (the first call loads it: ucx_library.h) or cannot start.
std::unique_ptr<Transport> make_ucx_transport(Store& store, const std::string& key_prefix, int rank,
                                              int world_size, const std::vector<int>& group,
                                              const TransportOptions& options,
                                              const UcxOptions& ucx,
                                              std::chrono::milliseconds timeout);

}  // namespace gradsync::transport
