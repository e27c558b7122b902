// ZeRO stages 1, 2 and 3 over units (see sharded.h). Each gather and each reduce-scatter is one
// call on the context's worker, its 16-bit conversions inside the call, so a Work that is done
// leaves float32 data ready: the thread running forward and backward only queues calls and
// waits for the ones it needs next.
#include "gradsync/sharded.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "collectives/algorithms.h"
#include "core/context_impl.h"
#include "ddp/sharded_schedule.h"
#include "gradsync/bytes.h"
#include "gradsync/error.h"
#include "gradsync/timeline.h"
#include "kernels/kernels.h"

namespace gradsync {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Floats left uninitialised: a vector zeroes every element it grows by, a pass over memory
// that a gather or backward is about to overwrite.
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(std::size_t capacity) : data_(new float[capacity]), capacity_(capacity) {}
  float* data() { return data_.get(); }
  const float* data() const { return data_.get(); }
  std::size_t size() const { return size_; }
  std::size_t capacity() const { return capacity_; }
  bool empty() const { return size_ == 0; }
  void resize(std::size_t n) { size_ = n; }  // n <= capacity
  float* begin() { return data(); }
  float* end() { return data() + size_; }
  std::span<float> span() { return {data(), size_}; }

 private:
  std::unique_ptr<float[]> data_;
  std::size_t capacity_ = 0, size_ = 0;
};

// Buffers handed out and taken back, so stage 3 allocates nothing once the first step has
// sized them: its working memory is the most it ever held at once.
class BufferPool {
 public:
  Buffer take(std::size_t floats) {
    // The smallest free buffer that fits; else a new one, in place of the largest free one
    // (which is too small), so that what the pool holds stays what was needed at once.
    auto best = free_.end(), largest = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->capacity() >= floats && (best == free_.end() || it->capacity() < best->capacity())) {
        best = it;
      }
      if (largest == free_.end() || it->capacity() > largest->capacity()) largest = it;
    }
    Buffer buffer;
    if (best != free_.end()) {
      buffer = std::move(*best);
      free_.erase(best);
    } else {
      if (largest != free_.end()) {
        allocated_ -= largest->capacity();
        free_.erase(largest);
      }
      buffer = Buffer(std::max<std::size_t>(floats, 1));
      allocated_ += buffer.capacity();
      peak_ = std::max(peak_, allocated_);
    }
    buffer.resize(floats);
    return buffer;
  }
  void give(Buffer& buffer) {
    if (buffer.capacity() == 0) return;
    free_.push_back(std::move(buffer));
    buffer = Buffer();
  }
  std::size_t peak_bytes() const { return peak_ * sizeof(float); }

 private:
  std::vector<Buffer> free_;
  std::size_t allocated_ = 0;  // floats, handed out or free
  std::size_t peak_ = 0;
};

// 16-bit elements in a float buffer: two per float, rounded up.
std::size_t floats_for_halves(std::size_t halves) {
  return (halves + 1) / 2;
}

std::uint16_t* as_halves(Buffer& buffer) {
  return reinterpret_cast<std::uint16_t*>(buffer.data());
}

constexpr std::size_t kInt8Block = 256;

// One rank's piece of an int8 reduce-scatter: a float scale per block, then a byte per
// element, padded to whole floats so that every piece's scales stay aligned.
std::size_t int8_piece_bytes(std::size_t shard) {
  return 4 * ((shard + kInt8Block - 1) / kInt8Block) + (shard + 3) / 4 * 4;
}

// The int8 reduce-scatter of a whole gradient of `ranks` shards: each piece (plus what its
// last rounding held back, `residual`) is quantised once, the new residual kept, and every
// rank sent its piece (an all-to-all); each rank then sums the pieces of its shard in rank
// order, in float32, into `target` (or over what it holds, unless `overwrite`). One rounding
// per element, all of it fed back: a ring would round again at every hop.
void int8_reduce_scatter(CallSteps& steps, float* grad, float* residual, std::size_t shard,
                         std::size_t ranks, std::uint8_t* send, std::uint8_t* recv, float* target,
                         bool overwrite) {
  const std::size_t blocks = (shard + kInt8Block - 1) / kInt8Block;
  const std::size_t piece = int8_piece_bytes(shard);
  const auto scales_of = [&](std::uint8_t* pieces, std::size_t j) {
    return reinterpret_cast<float*>(pieces + j * piece);
  };
  const auto values_of = [&](std::uint8_t* pieces, std::size_t j) {
    return reinterpret_cast<std::int8_t*>(pieces + j * piece + 4 * blocks);
  };
  for (std::size_t j = 0; j < ranks; ++j) {
    float* g = grad + j * shard;
    float* r = residual + j * shard;
    for (std::size_t i = 0; i < shard; ++i) g[i] += r[i];
    kernels::quantize_int8_blocks(g, shard, kInt8Block, scales_of(send, j), values_of(send, j));
    kernels::dequantize_int8_blocks(values_of(send, j), scales_of(send, j), shard, kInt8Block, r);
    for (std::size_t i = 0; i < shard; ++i) r[i] = g[i] - r[i];
  }
  const std::vector<std::size_t> counts(ranks, piece);
  steps.run({0, collectives::CollectiveKind::kAlltoallv, DataType::kUInt8, ReduceOp::kSum,
             Algorithm::kRing, -1, piece * ranks},
            [&](collectives::Comm& c) {
              collectives::alltoallv(c, send, counts, recv, counts, DataType::kUInt8);
            });
  if (overwrite) std::fill(target, target + shard, 0.0f);
  for (std::size_t j = 0; j < ranks; ++j) {
    kernels::dequantize_int8_blocks_add(values_of(recv, j), scales_of(recv, j), shard, kInt8Block,
                                        target);
  }
}

}  // namespace

struct ShardedDataParallel::State {
  struct Unit {
    std::string name;
    std::size_t count = 0;  // parameters, unpadded
    std::size_t shard = 0;  // per rank: count / N rounded up
    std::size_t first = 0;  // where its shard starts in the shard arrays
    // The whole copy, shard * N floats (the padding past count is zeros), while gathered.
    Buffer whole;
    bool gathered = false;  // `whole` holds the current values, or will once `gather` is done
    bool in_use = false;    // acquired and not released
    Work gather;
    Buffer gather_send, gather_recv;  // 16-bit wire scratch of the gather
    double gather_s = 0;              // written by the call, read once it is done
    // The whole gradient from gradient() to the end of its reduce-scatter.
    Buffer grad;
    // Stage 1 accumulating: the sum of this step's micro-batches before the last.
    Buffer accumulated;
    bool grad_out = false;  // handed out by gradient(), not yet marked ready
    Work reduce;
    bool reducing = false;
    Buffer reduce_send, reduce_scratch;  // 16-bit wire: send; receive, or sum
    double reduce_s = 0;
  };

  State(Context& c, ShardedOptions o)
      : ctx(c), options(o), ranks(static_cast<std::size_t>(c.size())) {
    if (options.stage < 1 || options.stage > 3) {
      fail("stage " + std::to_string(options.stage) + " (1, 2 or 3)", "ShardedDataParallel");
    }
    if (options.accumulate_steps < 1 || (options.stage > 1 && options.accumulate_steps != 1)) {
      fail("accumulate_steps " + std::to_string(options.accumulate_steps) + " at stage " +
               std::to_string(options.stage) +
               (options.stage > 1 ? " (stages 2 and 3 keep only a shard of the gradient, so "
                                    "they reduce-scatter every micro-batch: 1; stage 1 "
                                    "accumulates whole gradients)"
                                  : " (at least 1)"),
           "ShardedDataParallel");
    }
    if (options.wire != DataType::kFloat32 && options.wire != DataType::kBFloat16 &&
        options.wire != DataType::kFloat16) {
      fail(std::string("wire dtype ") + to_string(options.wire) + " (float32, bfloat16 or float16)",
           "ShardedDataParallel");
    }
    if (options.prefetch_depth < 0) {
      fail("prefetch_depth " + std::to_string(options.prefetch_depth) + " (0 or more)",
           "ShardedDataParallel");
    }
    if (options.gradient_wire != DataType::kFloat32 && options.gradient_wire != DataType::kInt8) {
      fail(std::string("gradient wire dtype ") + to_string(options.gradient_wire) +
               " (int8, or float32 to follow the wire)",
           "ShardedDataParallel");
    }
  }

  ~State() {
    for (Unit& u : units) {
      quiet_wait(u.gather);
      quiet_wait(u.reduce);
    }
  }

  [[noreturn]] void fail(const std::string& what, const char* op) const {
    throw Error(ErrorKind::kInvalidArgument, what, ctx.rank(), Error::kNoPeer, op);
  }

  static void quiet_wait(Work& w) {
    try {
      w.wait();
    } catch (const Error&) {  // reported where the call was waited for, or not wanted any more
    }
  }

  const Unit& unit(int id, const char* op) const {
    if (id < 0 || static_cast<std::size_t>(id) >= units.size()) {
      fail("no unit " + std::to_string(id) + " (" + std::to_string(units.size()) + " registered)",
           op);
    }
    return units[static_cast<std::size_t>(id)];
  }
  Unit& unit(int id, const char* op) {
    return const_cast<Unit&>(static_cast<const State&>(*this).unit(id, op));
  }

  // Sets unit `u` to `unit_values`, its whole parameters, identical on every rank: this rank's
  // slice into its shard (zeros past the unit's end) and, at stage 2, the whole copy. No call
  // of the unit may be in flight: a gather reads the shard and writes the whole copy.
  void set_values(Unit& u, std::span<const float> unit_values) {
    const std::size_t from = std::min(u.count, u.shard * static_cast<std::size_t>(ctx.rank()));
    const std::size_t to = std::min(u.count, from + u.shard);
    float* shard = values.data() + u.first;
    std::fill(std::copy(unit_values.begin() + static_cast<std::ptrdiff_t>(from),
                        unit_values.begin() + static_cast<std::ptrdiff_t>(to), shard),
              shard + u.shard, 0.0f);
    if (whole_parameters()) std::copy(unit_values.begin(), unit_values.end(), u.whole.begin());
  }

  // Stages 1 and 2 keep every unit's parameters whole between steps.
  bool whole_parameters() const { return options.stage < 3; }
  // Whether this micro-batch's gradients are reduce-scattered: stage 1 sends only the sum of
  // a step's micro-batches, in the last one's backward.
  bool reduces_now() const { return (micro_batches + 1) % options.accumulate_steps == 0; }
  bool wire16() const { return options.wire != DataType::kFloat32; }
  std::size_t prefetch_depth() const { return static_cast<std::size_t>(options.prefetch_depth); }
  bool int8_gradients() const { return options.gradient_wire == DataType::kInt8; }
  // Whether the gradients' sum arrives divided by the ranks (16-bit wires divide first).
  bool gradients_pre_divided() const { return wire16() && !int8_gradients(); }

  // A call of this unit: its id as the call's root, so ranks that reach different units fail
  // with kMismatch at the first message rather than combine them.
  collectives::CallSignature signature(collectives::CollectiveKind kind, DataType dtype,
                                       const Unit& u, std::size_t id) const {
    return {0,
            kind,
            dtype,
            ReduceOp::kSum,
            Algorithm::kRing,
            static_cast<std::int32_t>(id),
            u.shard * ranks};
  }

  // Queues the gather of unit `id` into a whole copy from the pool.
  void start_gather(std::size_t id) {
    Unit& u = units[id];
    if (u.whole.empty()) u.whole = pool.take(u.shard * ranks);  // stage 2 keeps its own
    u.gathered = true;
    const float* shard = values.data() + u.first;
    float* whole = u.whole.data();
    std::uint16_t *send16 = nullptr, *recv16 = nullptr;
    if (wire16()) {
      u.gather_send = pool.take(floats_for_halves(u.shard));
      u.gather_recv = pool.take(floats_for_halves(u.shard * ranks));
      send16 = as_halves(u.gather_send);
      recv16 = as_halves(u.gather_recv);
    }
    const std::size_t shard_count = u.shard, whole_count = u.shard * ranks;
    const DataType wire = options.wire;
    double* seconds = &u.gather_s;
    const std::string span = "allgather " + u.name;
    u.gather = detail::ContextAccess::impl(ctx).submit_steps(
        signature(collectives::CollectiveKind::kAllgather, options.wire, u, id),
        [=](CallSteps& steps) {
          timeline::Span s(span, "comm");
          const auto t0 = Clock::now();
          if (!send16) {
            steps.allgather(shard, whole, shard_count, DataType::kFloat32);
          } else {
            kernels::float_to_16bit(shard, send16, shard_count, wire);
            steps.allgather(send16, recv16, shard_count, wire);
            kernels::float_from_16bit(recv16, whole, whole_count, wire);
          }
          *seconds = seconds_between(t0, Clock::now());
        },
        false);
    ++calls;
  }

  // Waits for unit `id`'s gather (if one is in flight), counting the wait as exposed: as the
  // gather's, up to the time the gather itself ran, the rest as the calls queued before it.
  void finish_gather(Unit& u) {
    if (!u.gather.test()) {
      const auto t0 = Clock::now();
      u.gather.wait();
      const double waited = seconds_between(t0, Clock::now());
      exposed_gather_s += std::min(waited, u.gather_s);
      exposed_s += waited;
    } else {
      u.gather.wait();  // rethrows its error
    }
    if (u.gather_s > 0) {
      gather_s += u.gather_s;
      u.gather_s = 0;
    }
    pool.give(u.gather_send);
    pool.give(u.gather_recv);
    u.gather = Work();
  }

  // Stage 3: gives the whole copy back to the pool.
  void drop(Unit& u) {
    if (!u.gathered) return;
    finish_gather(u);
    pool.give(u.whole);
    u.gathered = false;
  }

  // Queues the reduce-scatter of unit `id`'s gradient, adding into this rank's shard of the
  // gradient (the first micro-batch since the step overwrites it).
  void start_reduce(std::size_t id) {
    Unit& u = units[id];
    float* grad = u.grad.data();
    float* target = gradients.data() + u.first;
    const bool overwrite = reduced_batches == 0;
    const std::size_t shard_count = u.shard, whole_count = u.shard * ranks;
    float* scratch = nullptr;
    std::uint16_t *send16 = nullptr, *recv16 = nullptr;
    std::uint8_t *send8 = nullptr, *recv8 = nullptr;
    float* residual = residuals.data() + u.first * ranks;
    if (int8_gradients()) {
      const std::size_t floats = int8_piece_bytes(shard_count) * ranks / sizeof(float);
      u.reduce_send = pool.take(floats);
      u.reduce_scratch = pool.take(floats);
      send8 = reinterpret_cast<std::uint8_t*>(u.reduce_send.data());
      recv8 = reinterpret_cast<std::uint8_t*>(u.reduce_scratch.data());
    } else if (wire16()) {
      u.reduce_send = pool.take(floats_for_halves(whole_count));
      send16 = as_halves(u.reduce_send);
      u.reduce_scratch = pool.take(floats_for_halves(shard_count) + (overwrite ? 0 : shard_count));
      recv16 = as_halves(u.reduce_scratch);
      if (!overwrite) scratch = u.reduce_scratch.data() + floats_for_halves(shard_count);
    } else if (!overwrite) {
      u.reduce_scratch = pool.take(shard_count);
      scratch = u.reduce_scratch.data();
    }
    const DataType wire = options.wire;
    const float inverse_ranks = 1.0f / static_cast<float>(ranks);
    double* seconds = &u.reduce_s;
    const std::string span = "reduce_scatter " + u.name;
    const std::size_t rank_count = ranks;
    u.reduce = detail::ContextAccess::impl(ctx).submit_steps(
        signature(collectives::CollectiveKind::kReduceScatter,
                  int8_gradients() ? DataType::kInt8 : options.wire, u, id),
        [=](CallSteps& steps) {
          timeline::Span s(span, "comm");
          const auto t0 = Clock::now();
          if (send8) {
            int8_reduce_scatter(steps, grad, residual, shard_count, rank_count, send8, recv8,
                                target, overwrite);
            *seconds = seconds_between(t0, Clock::now());
            return;
          }
          float* out = overwrite ? target : scratch;
          if (!send16) {
            steps.reduce_scatter(grad, out, shard_count, DataType::kFloat32, ReduceOp::kSum);
          } else {
            // Divided by the ranks before rounding, so that an fp16 sum cannot overflow.
            for (std::size_t i = 0; i < whole_count; ++i) grad[i] *= inverse_ranks;
            kernels::float_to_16bit(grad, send16, whole_count, wire);
            steps.reduce_scatter(send16, recv16, shard_count, wire, ReduceOp::kSum);
            kernels::float_from_16bit(recv16, out, shard_count, wire);
          }
          if (!overwrite) {
            for (std::size_t i = 0; i < shard_count; ++i) target[i] += scratch[i];
          }
          *seconds = seconds_between(t0, Clock::now());
        },
        false);
    u.reducing = true;
    ++calls;
    raw_bytes += u.count * sizeof(float);
  }

  // Takes back a finished reduce-scatter's buffers; `block` waits for it, counted as exposed.
  bool reap_reduce(Unit& u, bool block) {
    if (!u.reducing) return true;
    if (!u.reduce.test()) {
      if (!block) return false;
      const auto t0 = Clock::now();
      u.reduce.wait();
      exposed_s += seconds_between(t0, Clock::now());
    } else {
      u.reduce.wait();  // rethrows its error
    }
    reduce_s += u.reduce_s;
    u.reduce_s = 0;
    pool.give(u.grad);
    pool.give(u.reduce_send);
    pool.give(u.reduce_scratch);
    u.reducing = false;
    u.reduce = Work();
    return true;
  }

  Context& ctx;
  ShardedOptions options;
  std::size_t ranks;
  std::vector<Unit> units;
  std::size_t shard_floats = 0;  // every unit's shard, back to back
  std::vector<float> values;     // this rank's shards of the parameters (float32 master copy)
  std::vector<float> gradients;  // and of the gradient, summed over ranks and micro-batches
  std::vector<float> residuals;  // int8 gradients: what rounding held back, whole per unit
  std::unique_ptr<optim::Optimizer> optimizer;
  OptimizerFactory make_optimizer;  // for load_state_of_ranks: the old ranks' optimizers
  BufferPool pool;
  std::deque<std::size_t> reducing;  // units whose reduce-scatter is queued, oldest first
  int micro_batches = 0;             // finish() calls since the last step
  int reduced_batches = 0;           // of them, those that reduce-scattered
  bool in_backward = false;
  Clock::time_point backward_start;
  std::uint64_t bytes_at_finish = 0;
  // Since the last finish():
  double gather_s = 0, exposed_gather_s = 0, reduce_s = 0, exposed_s = 0;
  std::size_t calls = 0, reduced_units = 0;
  std::uint64_t raw_bytes = 0;
};

ShardedDataParallel::ShardedDataParallel(Context& ctx, ShardedOptions options)
    : s_(std::make_unique<State>(ctx, options)) {
  s_->bytes_at_finish = ctx.total_traffic().bytes_sent;
}

ShardedDataParallel::~ShardedDataParallel() = default;

int ShardedDataParallel::add_unit(std::string name, std::span<const float> initial) {
  State& s = *s_;
  if (s.optimizer) s.fail("add_unit after set_optimizer", "add_unit");
  State::Unit u;
  u.name = std::move(name);
  u.count = initial.size();
  u.shard = (u.count + s.ranks - 1) / s.ranks;
  u.first = s.shard_floats;
  s.shard_floats += u.shard;
  s.values.resize(s.shard_floats);
  if (s.whole_parameters()) {  // the initial values are the current ones
    u.whole = Buffer(u.shard * s.ranks);
    u.whole.resize(u.shard * s.ranks);
    std::fill(u.whole.begin(), u.whole.end(), 0.0f);  // the padding stays zero
    u.gathered = true;
  }
  s.set_values(u, initial);
  s.units.push_back(std::move(u));
  return static_cast<int>(s.units.size() - 1);
}

void ShardedDataParallel::set_optimizer(const OptimizerFactory& make) {
  State& s = *s_;
  auto optimizer = make(s.shard_floats);
  if (optimizer->needs_whole_tensors()) {
    s.fail("this optimizer needs each tensor whole (LARS, LAMB), and a shard cuts them anywhere",
           "set_optimizer");
  }
  s.optimizer = std::move(optimizer);
  s.make_optimizer = make;
  s.gradients.assign(s.shard_floats, 0.0f);
  if (s.int8_gradients()) s.residuals.assign(s.shard_floats * s.ranks, 0.0f);
  if (s.options.accumulate_steps > 1) {
    for (State::Unit& u : s.units) {
      u.accumulated = Buffer(u.shard * s.ranks);
      u.accumulated.resize(u.shard * s.ranks);
    }
  }
}

void ShardedDataParallel::set_lr(float lr) {
  if (!s_->optimizer) s_->fail("set_lr before set_optimizer", "set_lr");
  s_->optimizer->set_lr(lr);
}

std::span<const float> ShardedDataParallel::acquire(int id, Pass pass) {
  State& s = *s_;
  State::Unit& u = s.unit(id, "acquire");
  if (u.in_use) s.fail("unit " + u.name + " acquired twice", "acquire");
  const auto index = static_cast<std::size_t>(id);
  if (!u.gathered) s.start_gather(index);
  if (s.options.stage == 3) {
    const std::size_t units = s.units.size();
    const std::size_t use = ddp::zero3::use_of(index, pass == Pass::kBackward, units);
    const std::size_t last = std::min(use + s.prefetch_depth(), ddp::zero3::last_use(units));
    for (std::size_t next = use + 1; next <= last; ++next) {
      const std::size_t ahead = ddp::zero3::use_at(next, units).unit;
      if (!s.units[ahead].gathered) s.start_gather(ahead);
    }
  }
  s.finish_gather(u);
  u.in_use = true;
  return u.whole.span().first(u.count);
}

void ShardedDataParallel::release(int id, Pass pass) {
  State& s = *s_;
  State::Unit& u = s.unit(id, "release");
  if (!u.in_use) s.fail("unit " + u.name + " released without being acquired", "release");
  u.in_use = false;
  const bool kept_for_backward =
      pass == Pass::kForward && ddp::zero3::kept_for_backward(static_cast<std::size_t>(id),
                                                              s.units.size(), s.prefetch_depth());
  if (s.options.stage == 3 && !kept_for_backward) s.drop(u);
}

std::span<float> ShardedDataParallel::gradient(int id) {
  State& s = *s_;
  State::Unit& u = s.unit(id, "gradient");
  if (!s.optimizer) s.fail("gradient before set_optimizer", "gradient");
  if (u.reducing) s.fail("gradient of unit " + u.name + " while it is reduced", "gradient");
  if (!u.grad_out) {
    if (!s.in_backward) {
      s.in_backward = true;
      s.backward_start = Clock::now();
    }
    u.grad = s.pool.take(u.shard * s.ranks);
    std::fill(u.grad.begin() + static_cast<std::ptrdiff_t>(u.count), u.grad.end(), 0.0f);
    u.grad_out = true;
  }
  return u.grad.span().first(u.count);
}

void ShardedDataParallel::mark_ready(int id) {
  State& s = *s_;
  State::Unit& u = s.unit(id, "mark_ready");
  if (!u.grad_out) s.fail("unit " + u.name + " marked ready without a gradient", "mark_ready");
  u.grad_out = false;
  if (!u.accumulated.empty()) {  // stage 1, accumulating: the sum goes out with the last
    float* sum = u.accumulated.data();
    float* grad = u.grad.data();
    const std::size_t n = u.accumulated.size();
    if (!s.reduces_now()) {
      if (s.micro_batches % s.options.accumulate_steps == 0) {
        std::copy(grad, grad + n, sum);
      } else {
        for (std::size_t i = 0; i < n; ++i) sum[i] += grad[i];
      }
      s.pool.give(u.grad);
      return;
    }
    for (std::size_t i = 0; i < n; ++i) grad[i] += sum[i];
  }
  s.start_reduce(static_cast<std::size_t>(id));
  s.reducing.push_back(static_cast<std::size_t>(id));
  ++s.reduced_units;
  // Give back the buffers of those done, and bound the whole gradients held when the link is
  // slower than backward (stage 3: zero3::reduce_scatters_in_flight). Stage 2, with no
  // gathers in backward, keeps two to stay ahead.
  const std::size_t in_flight =
      s.options.stage == 3 ? ddp::zero3::reduce_scatters_in_flight(s.prefetch_depth()) : 2;
  while (!s.reducing.empty() &&
         s.reap_reduce(s.units[s.reducing.front()], s.reducing.size() > in_flight)) {
    s.reducing.pop_front();
  }
}

StepStats ShardedDataParallel::finish() {
  State& s = *s_;
  for (const State::Unit& u : s.units) {
    if (u.grad_out) s.fail("unit " + u.name + " has a gradient never marked ready", "finish");
  }
  const auto called = Clock::now();
  while (!s.reducing.empty()) {
    s.reap_reduce(s.units[s.reducing.front()], true);
    s.reducing.pop_front();
  }
  StepStats stats;
  stats.communicated = s.reduces_now();
  stats.compute_s = s.in_backward ? seconds_between(s.backward_start, called) : 0;
  stats.communication_s = s.gather_s + s.reduce_s;
  stats.exposed_s = s.exposed_s;
  stats.gather_s = s.gather_s;
  stats.exposed_gather_s = s.exposed_gather_s;
  stats.overlap_fraction = stats.communication_s > 0
                               ? std::clamp(1.0 - stats.exposed_s / stats.communication_s, 0.0, 1.0)
                               : 0.0;
  const std::uint64_t sent = s.ctx.total_traffic().bytes_sent;
  stats.bytes_sent = sent - s.bytes_at_finish;
  s.bytes_at_finish = sent;
  stats.raw_bytes = s.raw_bytes;
  stats.allreduce_calls = s.calls;
  stats.buckets = s.reduced_units;
  s.gather_s = s.exposed_gather_s = s.reduce_s = s.exposed_s = 0;
  s.calls = s.reduced_units = 0;
  s.raw_bytes = 0;
  s.in_backward = false;
  if (stats.communicated) ++s.reduced_batches;
  ++s.micro_batches;
  return stats;
}

bool ShardedDataParallel::step(optim::LossScaler* scaler) {
  State& s = *s_;
  if (!s.optimizer) s.fail("step before set_optimizer", "step");
  if (s.micro_batches == 0) s.fail("step without a finished backward", "step");
  if (s.micro_batches % s.options.accumulate_steps != 0) {
    s.fail("step after " + std::to_string(s.micro_batches) + " micro-batches, with " +
               std::to_string(s.options.accumulate_steps) +
               " a step (the gradients go out with the last)",
           "step");
  }
  if (!s.reducing.empty()) s.fail("step with reduce-scatters not finished", "step");
  // Sums over ranks (16-bit wires were divided by the ranks before the sum) and micro-batches.
  const float divisor = static_cast<float>(s.micro_batches) *
                        (s.gradients_pre_divided() ? 1.0f : static_cast<float>(s.ranks));
  if (divisor != 1.0f) {
    const float inverse = 1.0f / divisor;
    for (float& g : s.gradients) g *= inverse;
  }
  s.micro_batches = s.reduced_batches = 0;
  if (scaler && !scaler->unscale(s.ctx, s.gradients)) return false;
  for (State::Unit& u : s.units) {
    if (u.in_use) s.fail("step while unit " + u.name + " is acquired", "step");
    // A gather in flight reads the shard about to step. Stage 3's copies are now out of date.
    if (s.options.stage == 3) {
      s.drop(u);
    } else {
      s.finish_gather(u);
    }
  }
  // Unit by unit in forward order, each unit's gather queued as soon as its shard has stepped,
  // while the later shards step: stages 1 and 2 refresh every unit in place (each waited for
  // by its next acquire); stage 3 gathers the next forward's first uses, as an acquire would
  // prefetch them, so that they need not wait for the whole step.
  const std::size_t prefetched =
      s.options.stage < 3 ? s.units.size() : ddp::zero3::gathered_by_step(s.prefetch_depth());
  std::vector<std::size_t> bounds{0};
  for (const State::Unit& u : s.units) bounds.push_back(u.first + u.shard);
  s.optimizer->step_pieces(s.values, s.gradients, bounds, [&](std::size_t id) {
    if (id < prefetched) s.start_gather(id);
  });
  return true;
}

std::vector<float> ShardedDataParallel::gather_values() {
  State& s = *s_;
  std::vector<float> all;
  std::vector<float> whole;
  for (State::Unit& u : s.units) {
    if (u.gathered) s.finish_gather(u);
    // float32 whatever the wire: a checkpoint keeps the master values exactly.
    whole.resize(u.shard * s.ranks);
    s.ctx.allgather(s.values.data() + u.first, whole.data(), u.shard, DataType::kFloat32);
    all.insert(all.end(), whole.begin(), whole.begin() + static_cast<std::ptrdiff_t>(u.count));
  }
  return all;
}

void ShardedDataParallel::load_values(std::span<const float> all) {
  State& s = *s_;
  std::size_t total = 0;
  for (const State::Unit& u : s.units) total += u.count;
  if (all.size() != total) {
    s.fail(std::to_string(all.size()) + " values for units of " + std::to_string(total),
           "load_values");
  }
  std::size_t at = 0;
  for (State::Unit& u : s.units) {
    if (u.in_use) s.fail("load_values while unit " + u.name + " is acquired", "load_values");
    // A gather in flight reads the shard: wait for it before writing (stage 3 drops the copy,
    // now out of date).
    if (s.options.stage == 3) {
      s.drop(u);
    } else {
      s.finish_gather(u);
    }
    s.set_values(u, all.subspan(at, u.count));
    at += u.count;
  }
}

// "GSSD" v1: the optimizer's state (bytes), then the error-feedback residuals (floats).
std::vector<std::uint8_t> ShardedDataParallel::save_state() const {
  if (!s_->optimizer) s_->fail("save_state before set_optimizer", "save_state");
  ByteWriter w("GSSD", 1);
  w.bytes(s_->optimizer->save_state());
  w.floats(s_->residuals);
  return w.take();
}

void ShardedDataParallel::load_state(std::span<const std::uint8_t> state) {
  State& s = *s_;
  if (!s.optimizer) s.fail("load_state before set_optimizer", "load_state");
  ByteReader r(state, "GSSD", 1, "sharded state");
  const std::span<const std::uint8_t> optimizer = r.bytes();
  std::vector<float> residuals = r.floats();
  r.finish();
  if (residuals.size() != s.residuals.size()) {
    r.fail("holds " + std::to_string(residuals.size()) + " error-feedback floats, this one keeps " +
           std::to_string(s.residuals.size()));
  }
  s.optimizer->load_state(optimizer);
  s.residuals = std::move(residuals);
}

void ShardedDataParallel::load_state_of_ranks(std::span<const std::vector<std::uint8_t>> states) {
  State& s = *s_;
  const char* op = "load_state_of_ranks";
  if (!s.optimizer) s.fail("load_state_of_ranks before set_optimizer", op);
  if (states.empty()) s.fail("no states to load", op);
  const std::size_t old_ranks = states.size();
  // The old layout: each unit cut into old_ranks shards of old_shard[u], back to back at
  // old_first[u] of every old rank's arrays.
  std::vector<std::size_t> old_shard, old_first;
  std::size_t old_floats = 0;
  for (const State::Unit& u : s.units) {
    old_shard.push_back((u.count + old_ranks - 1) / old_ranks);
    old_first.push_back(old_floats);
    old_floats += old_shard.back();
  }
  std::optional<optim::Optimizer::Planes> mine = s.optimizer->planes();
  if (!mine)
    s.fail("this optimizer's state is not per-element planes, so it cannot be re-sharded", op);
  for (auto& plane : mine->planes) std::fill(plane.begin(), plane.end(), 0.0f);  // the padding
  std::vector<float> own_residuals;
  const auto rank = static_cast<std::size_t>(s.ctx.rank());
  for (std::size_t j = 0; j < old_ranks; ++j) {
    ByteReader r(states[j], "GSSD", 1, "sharded state of rank " + std::to_string(j));
    const std::span<const std::uint8_t> bytes = r.bytes();
    std::vector<float> residuals = r.floats();
    r.finish();
    auto old = s.make_optimizer(old_floats);
    try {
      old->load_state(bytes);  // refuses state of another size: other units or ranks
    } catch (const Error& e) {
      throw Error(e.kind(), "sharded state of rank " + std::to_string(j) + ": " + e.detail(),
                  s.ctx.rank(), Error::kNoPeer, op);
    }
    const std::optional<optim::Optimizer::Planes> theirs = old->planes();
    if (!theirs || theirs->planes.size() != mine->planes.size()) {
      s.fail("rank " + std::to_string(j) + "'s optimizer state has other planes than this one's",
             op);
    }
    if (j > 0 && theirs->steps != mine->steps) {
      r.fail("took " + std::to_string(theirs->steps) + " steps where rank 0's took " +
             std::to_string(mine->steps));
    }
    mine->steps = theirs->steps;
    // Element e of a unit was at old rank e / old_shard, and is ours if it falls in our shard.
    for (std::size_t id = 0; id < s.units.size(); ++id) {
      const State::Unit& u = s.units[id];
      const std::size_t begin = std::max(j * old_shard[id], rank * u.shard);
      const std::size_t end = std::min({(j + 1) * old_shard[id], (rank + 1) * u.shard, u.count});
      for (std::size_t k = 0; k < mine->planes.size(); ++k) {
        for (std::size_t e = begin; e < end; ++e) {
          mine->planes[k][u.first + e - rank * u.shard] =
              theirs->planes[k][old_first[id] + e - j * old_shard[id]];
        }
      }
    }
    if (j == rank && residuals.size() == old_floats * old_ranks)
      own_residuals = std::move(residuals);
  }
  s.optimizer->load_planes(*mine);
  // Int8 error feedback is whole per unit (unit u's at first * ranks): this rank's own, moved
  // to the new padding.
  std::fill(s.residuals.begin(), s.residuals.end(), 0.0f);
  if (!s.residuals.empty() && !own_residuals.empty()) {
    for (std::size_t id = 0; id < s.units.size(); ++id) {
      const State::Unit& u = s.units[id];
      std::copy_n(own_residuals.begin() + static_cast<std::ptrdiff_t>(old_first[id] * old_ranks),
                  u.count, s.residuals.begin() + static_cast<std::ptrdiff_t>(u.first * s.ranks));
    }
  }
}

ShardedDataParallel::Memory ShardedDataParallel::memory() const {
  const State& s = *s_;
  Memory m;
  m.parameter_bytes = s.shard_floats * sizeof(float);
  m.gradient_bytes = s.gradients.size() * sizeof(float);
  for (const State::Unit& u : s.units) {
    if (s.whole_parameters()) m.parameter_bytes += u.whole.size() * sizeof(float);
    m.gradient_bytes += u.accumulated.size() * sizeof(float);
  }
  m.optimizer_state_bytes = s.optimizer ? s.optimizer->state_bytes() : 0;
  m.working_bytes = s.pool.peak_bytes();
  m.error_feedback_bytes = s.residuals.size() * sizeof(float);
  return m;
}

std::size_t ShardedDataParallel::units() const {
  return s_->units.size();
}

std::size_t ShardedDataParallel::unit_size(int id) const {
  return s_->unit(id, "unit_size").count;
}

}  // namespace gradsync
