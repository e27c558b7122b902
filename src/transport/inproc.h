// In-process transport: ranks are threads of one process (the test harness). Sends are
// buffered copies, so a send completes at once; receives match in FIFO order per peer.
#pragma once

#include <memory>
#include <vector>

#include "transport/transport.h"

namespace gradsync::transport {

class InprocGroup;

// Creates the shared state of a group of `size` thread-ranks.
std::shared_ptr<InprocGroup> make_inproc_group(int size);

// The transport endpoint of `rank` in `group`.
std::unique_ptr<Transport> make_inproc_transport(std::shared_ptr<InprocGroup> group, int rank,
                                                 const TransportOptions& options = {});

}  // namespace gradsync::transport
