// Shared-memory transport for ranks on one host: POSIX shared memory rings, no sockets on
// the data path, futex wake-ups after a short spin, dead-peer detection by process id.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "gradsync/store.h"
#include "transport/transport.h"

namespace gradsync::transport {

struct ShmOptions {
  // How long an idle waiter looks for progress before it sleeps on its futex (Options::
  // shm_spin_us); -1: by the cores there are (see kSpinBeforeSleep in shm_group.h).
  int spin_us = -1;
};

// Collective call: every rank in `group` (global ranks on this host, sorted, including
// `rank`) calls it with the same `key_prefix` (unique per job and context). Exchanges
// segment names through `store`. Unlinks every segment from /dev/shm before returning,
// so nothing is left behind however the processes exit.
std::unique_ptr<Transport> make_shm_transport(Store& store, const std::string& key_prefix, int rank,
                                              int world_size, const std::vector<int>& group,
                                              const TransportOptions& options,
                                              std::chrono::milliseconds timeout,
                                              const ShmOptions& shm = {});

}  // namespace gradsync::transport
