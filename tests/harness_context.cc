// Thread-rank contexts over the inproc transport (kept apart from harness.cc so tests that
// need no context do not pull the context in).
#include "core/context_impl.h"
#include "harness.h"
#include "transport/inproc.h"

namespace gradsync::testing {

void run_inproc_contexts(int n, const std::function<void(Context&)>& fn, Options options) {
  auto group = transport::make_inproc_group(n);
  transport::TransportOptions topts;
  topts.format_tag = collectives::describe_tag;
  run_threads(n, [&](int rank) {
    // Fixed cost constants: calibration would make algorithm choice timing-dependent.
    auto ctx = make_context(transport::make_inproc_transport(group, rank, topts), options,
                            model::LinkParams{});
    fn(*ctx);
  });
}

}  // namespace gradsync::testing
