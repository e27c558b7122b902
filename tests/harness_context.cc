// Thread-rank contexts over the inproc and shm transports (kept apart from harness.cc so tests
// that need no context do not pull the context in).
#include <chrono>
#include <latch>

#include "core/context_impl.h"
#include "harness.h"
#include "transport/inproc.h"
#include "transport/shm.h"

namespace gradsync::testing {

void run_inproc_contexts(int n, const std::function<void(Context&)>& fn, Options options) {
  auto group = transport::make_inproc_group(n);
  transport::TransportOptions topts;
  topts.format_tag = collectives::describe_tag;
  run_threads(n, [&](int rank) {
    // Fixed cost constants: calibration would make algorithm choice timing-dependent.
    auto ctx = make_context(transport::make_inproc_transport(group, rank, topts), options,
                            cost::LinkParams{});
    fn(*ctx);
  });
}

void run_shm_contexts(int n, const std::function<void(Context&)>& fn, Options options) {
  auto store = make_inproc_store();
  const std::string prefix = unique_name("shm-contexts");
  const std::vector<int> group = all_ranks(n);
  transport::TransportOptions topts;
  topts.format_tag = collectives::describe_tag;
  // A rank that finishes keeps its context until every rank has: an early finisher must not
  // look like a lost peer to ranks still waiting (its transport would report itself closed).
  // A rank that fails lets go at once, so the others notice instead of running into timeouts.
  std::latch all_done(n);
  run_threads(n, [&](int rank) {
    try {
      // Setup is collective: every rank maps every other's segment, so all run at once.
      auto t = transport::make_shm_transport(*store, prefix, rank, n, group, topts,
                                             std::chrono::seconds(60));
      auto ctx = make_context(std::move(t), options, cost::LinkParams{});
      fn(*ctx);
      all_done.arrive_and_wait();
    } catch (...) {
      all_done.count_down();
      throw;
    }
  });
}

}  // namespace gradsync::testing
