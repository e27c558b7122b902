// Runs the transport conformance suite against the in-process transport.
#include "harness.h"
#include "transport/inproc.h"
#include "transport_conformance.h"

namespace gradsync::transport {
namespace {

void run_inproc(int n, const TransportOptions& options, const RankBody& body) {
  auto group = make_inproc_group(n);
  std::vector<std::unique_ptr<Transport>> transports;
  for (int r = 0; r < n; ++r) transports.push_back(make_inproc_transport(group, r, options));
  testing::run_threads(n, [&](int r) { body(r, *transports[static_cast<std::size_t>(r)]); });
}

INSTANTIATE_TEST_SUITE_P(Inproc, TransportConformance,
                         ::testing::Values(TransportFactory{"inproc", run_inproc}),
                         TransportFactoryName);

}  // namespace
}  // namespace gradsync::transport
