// Wrapping a transport into a context, and the cost-model calibration every rank agrees on.
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

// Rank 0 and rank 1 time a ping-pong for alpha and beta, rank 0 times the float32 sum
// kernel for gamma, and rank 0 broadcasts all three: every rank must choose the same
// algorithm for the same call, so they must share one set of constants.
model::LinkParams measure_link(Comm& c) {
  double values[3] = {0, 0, 0};
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
    pingpong(0, 5);  // warm-up: page in buffers, wake the peer
    const double alpha = pingpong(0, 20);
    pingpong(buf.size(), 1);
    const double big = pingpong(buf.size(), 4);
    if (c.rank() == 0) {
      std::vector<float> a(1 << 18, 1.0f), b(1 << 18, 2.0f);
      kernels::reduce_into(a.data(), b.data(), a.size(), DataType::kFloat32, ReduceOp::kSum);
      auto t0 = Clock::now();
      for (int i = 0; i < 8; ++i) {
        kernels::reduce_into(a.data(), b.data(), a.size(), DataType::kFloat32, ReduceOp::kSum);
      }
      const double reduce_s = seconds_since(t0) / 8;
      values[0] = std::max(alpha, 0.1);
      values[1] = static_cast<double>(buf.size()) / std::max(big - alpha, 1e-3) / 1e3;
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
    CallSignature sig{0, CollectiveKind::kInternal, DataType::kFloat64, ReduceOp::kSum,
                      Algorithm::kAuto, 0, 3};
    impl->submit(sig, [&](Comm& c) { measured = measure_link(c); }, true).wait();
    cost = measured;
  }
  impl->cost = model::CostModel(cost.value_or(model::LinkParams{}));
  return std::make_unique<Context>(std::move(impl));
}

}  // namespace gradsync
