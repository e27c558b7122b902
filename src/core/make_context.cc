// Wrapping a transport into a context, and the cost-model calibration every rank agrees on.
#include <algorithm>
#include <chrono>
#include <vector>

#include "core/context_impl.h"
#include "core/env.h"
#include "kernels/kernels.h"

namespace gradsync {

using collectives::CallSignature;
using collectives::CollectiveKind;
using collectives::Comm;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Alpha is one round of a dissemination barrier over all ranks (a message each way, every
// rank at once), so it includes what a two-rank ping-pong cannot see: ranks that share a
// core wait for each other to be scheduled (4 ranks on 2 cores: ~0.4 us between two ranks,
// ~5 us over all four). Rank 0 and rank 1 time a 1 MiB ping-pong for beta, rank 0 times
// the float32 sum kernel for gamma, and rank 0 broadcasts all three: every rank must choose
// the same algorithm for the same call, so they must share one set of constants.
model::LinkParams measure_link(Comm& c) {
  double values[3] = {0, 0, 0};
  int rounds_per_barrier = 0;
  for (int k = 1; k < c.size(); k <<= 1) ++rounds_per_barrier;
  // The fastest of several batches: a rank still finishing its start-up (or another process
  // passing through) slows a batch down, while ranks that must share cores slow down every
  // batch, since no barrier completes before each rank has run.
  collectives::barrier(c);  // warm-up: page in, wake everyone
  constexpr int kBatches = 8, kBarriersPerBatch = 5;
  double alpha = 1e9;
  for (int b = 0; b < kBatches; ++b) {
    const auto batch_start = Clock::now();
    for (int i = 0; i < kBarriersPerBatch; ++i) collectives::barrier(c);
    alpha = std::min(alpha,
                     seconds_since(batch_start) * 1e6 / (kBarriersPerBatch * rounds_per_barrier));
  }
  if (c.rank() <= 1) {
    const int peer = 1 - c.rank();
    std::vector<unsigned char> buf(1 << 20);
    auto pingpong = [&](std::size_t bytes, int rounds) {
      auto t0 = Clock::now();
      for (int i = 0; i < rounds; ++i) {
        if (c.rank() == 0) {
          c.send(peer, buf.data(), bytes);
          c.recv(peer, buf.data(), bytes);
        } else {
          c.recv(peer, buf.data(), bytes);
          c.send(peer, buf.data(), bytes);
        }
      }
      return seconds_since(t0) * 1e6 / (2.0 * rounds);  // one-way microseconds
    };
    pingpong(buf.size(), 1);  // warm-up: page in the buffers
    double big = 1e9;         // the fastest of a few, as for alpha
    for (int i = 0; i < 4; ++i) big = std::min(big, pingpong(buf.size(), 1));
    if (c.rank() == 0) {
      std::vector<float> a(1 << 18, 1.0f), b(1 << 18, 2.0f);
      kernels::reduce_into(a.data(), b.data(), a.size(), DataType::kFloat32, ReduceOp::kSum);
      auto t0 = Clock::now();
      for (int i = 0; i < 8; ++i) {
        kernels::reduce_into(a.data(), b.data(), a.size(), DataType::kFloat32, ReduceOp::kSum);
      }
      const double reduce_s = seconds_since(t0) / 8;
      values[0] = std::max(alpha, 0.1);
      // One message's latency is under 1% of a 1 MiB transfer: not worth subtracting.
      values[1] = static_cast<double>(buf.size()) / std::max(big, 1e-3) / 1e3;
      values[2] = static_cast<double>(a.size() * sizeof(float)) / std::max(reduce_s, 1e-9) / 1e9;
    }
  }
  collectives::AlgorithmConfig cfg;
  collectives::broadcast(c, values, 3, DataType::kFloat64, 0, cfg);
  return model::LinkParams{values[0], values[1], values[2]};
}

}  // namespace

std::unique_ptr<Context> make_context(std::unique_ptr<transport::Transport> transport,
                                      const Options& options,
                                      std::optional<model::LinkParams> cost) {
  auto impl = std::make_unique<Context::Impl>();
  impl->rank = transport->rank();
  impl->size = transport->size();
  impl->local_rank = options.local_rank >= 0 ? options.local_rank : impl->rank;
  impl->local_size = options.local_world_size >= 0 ? options.local_world_size : impl->size;
  impl->timeout = options.timeout.count() > 0 ? options.timeout : std::chrono::milliseconds(300000);
  impl->forced_algorithm = options.algorithm;
  for (int p = 0; p < impl->size; ++p) {
    impl->peer_transport.push_back(p == impl->rank ? "self" : transport->name());
  }
  impl->transport = std::move(transport);
  if (!cost) {
    if (auto spec = env::get("GRADSYNC_COST_MODEL")) {
      cost = model::CostModel::parse(*spec);
      if (!cost) {
        throw Error(ErrorKind::kInvalidArgument,
                    "GRADSYNC_COST_MODEL='" + *spec +
                        "' is not like alpha_us=3,bandwidth_gbps=8,reduce_gbps=20",
                    impl->rank);
      }
      env::log_override("GRADSYNC_COST_MODEL", *spec);
    }
  }
  if (!cost && impl->size > 1) {
    model::LinkParams measured;
    CallSignature sig{
        0, CollectiveKind::kInternal, DataType::kFloat64, ReduceOp::kSum, Algorithm::kAuto, 0, 3};
    impl->submit(
            sig, [&](Comm& c) { measured = measure_link(c); }, true)
        .wait();
    cost = measured;
  }
  impl->cost = model::CostModel(cost.value_or(model::LinkParams{}));
  return std::make_unique<Context>(std::move(impl));
}

}  // namespace gradsync
