// The bucketed, overlapped gradient reducer (see reducer.h). Buckets launch strictly in
// bucket order on every rank, each as one call queued on the context's engine, so ranks never
// issue mismatched collectives; a step ends with one 8-byte all-reduce that makes every rank
// agree on whether some rank left a parameter unready.
#include "gradsync/reducer.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>

#include "compress/codecs.h"
#include "compress/compressed_steps.h"
#include "core/context_impl.h"
#include "ddp/buckets.h"
#include "gradsync/bytes.h"
#include "gradsync/compress.h"
#include "gradsync/error.h"
#include "gradsync/timeline.h"

namespace gradsync {

namespace {
using Clock = std::chrono::steady_clock;
// The layout of save_state's bytes (gradsync/bytes.h): a new layout takes the next number.
constexpr std::uint32_t kStateVersion = 2;
double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
[[noreturn]] void misuse(const Context& ctx, const std::string& what) {
  throw Error(ErrorKind::kInvalidArgument, what, ctx.rank(), Error::kNoPeer, "reducer");
}
}  // namespace

struct Reducer::State {
  struct Param {
    std::string name;
    std::size_t count = 0, rows = 0;
    std::span<float> external;  // empty: the gradient lives in bucket memory
    int bucket = -1;
    std::size_t offset = 0;  // in the bucket, floats
    bool ready = false;
  };
  struct Bucket {
    std::vector<int> params;
    // The bucket's floats: its own memory, or (`view`) the caller's, where its parameters'
    // gradients tile one range of it.
    std::vector<float> data;
    std::span<float> view;
    std::size_t pending = 0;  // parameters not yet ready this step
    // This step's call on the engine; what it measured, written there and read once it is done.
    Work work;
    double communication_s = 0;
    std::size_t calls = 0;
    // Error feedback's residual and momentum of the bucket's floats (at the parameters'
    // offsets), kept here rather than in the codec so that they move with the gradients when
    // the buckets are rebuilt; empty without feedback (momentum: without momentum).
    std::vector<float> residual, momentum;
    // A whole-bucket call's tensor name and its parameters' slices, fixed when it is built.
    std::string name;
    std::vector<compress::TensorSlice> parts;
    std::span<float> values() { return view.empty() ? std::span<float>(data) : view; }
  };

  State(Context& c, ReducerOptions o)
      : ctx(c),
        options(std::move(o)),
        codec(compress::make_codec(options.codec)),
        feedback(dynamic_cast<compress::ErrorFeedback*>(codec.get())),
        // The registry says which codecs take a whole bucket per call; the others go parameter
        // by parameter, where their state (PowerSGD's Q) and shape belong.
        whole_buckets(codec->traits().whole_buckets) {
    if (options.accumulate_steps < 1) misuse(ctx, "accumulate_steps must be at least 1");
  }

  // The engine may still run this step's buckets (a step that threw): they use the codec and
  // the bucket memory, so they finish first.
  ~State() {
    for (Bucket& b : buckets) {
      try {
        b.work.wait();
      } catch (const Error&) {  // reported by finish(), or not wanted any more
      }
    }
  }

  // Buckets over `order` (parameter ids, first to be ready first), as assign_buckets groups
  // them. Gradients already in bucket memory move with their parameter.
  void build(const std::vector<int>& order) {
    std::vector<std::size_t> counts;
    for (int id : order) counts.push_back(params[static_cast<std::size_t>(id)].count);
    std::vector<Bucket> fresh;
    std::vector<std::size_t> floats;  // per fresh bucket
    for (const auto& positions :
         ddp::assign_buckets(counts, options.first_bucket_bytes, options.bucket_bytes)) {
      fresh.emplace_back();
      floats.push_back(0);
      for (std::size_t at : positions) {
        fresh.back().params.push_back(order[at]);
        floats.back() += counts[at];
      }
    }
    for (std::size_t b = 0; b < fresh.size(); ++b) {
      Bucket& bucket = fresh[b];
      view_if_contiguous(bucket);
      if (bucket.view.empty()) bucket.data.resize(floats[b]);
      std::size_t offset = 0;
      if (feedback) {
        bucket.residual.assign(bucket.values().size(), 0.0f);
        if (feedback->has_momentum()) bucket.momentum.assign(bucket.values().size(), 0.0f);
      }
      for (int id : bucket.params) {
        Param& p = params[static_cast<std::size_t>(id)];
        const std::size_t at =
            bucket.view.empty() ? offset
                                : static_cast<std::size_t>(p.external.data() - bucket.view.data());
        if (p.bucket >= 0 && p.count) {  // the gradient and the feedback state move with it
          Bucket& old = buckets[static_cast<std::size_t>(p.bucket)];
          if (bucket.view.empty()) copy_floats(old.values(), p.offset, bucket.data, at, p.count);
          copy_floats(old.residual, p.offset, bucket.residual, at, p.count);
          copy_floats(old.momentum, p.offset, bucket.momentum, at, p.count);
        }
        p.bucket = static_cast<int>(b);
        p.offset = at;
        offset += p.count;
        // An empty parameter's offset in a view bucket means nothing: it has no floats.
        if (p.count) bucket.parts.push_back({compress::Tensor(p.name, p.rows), p.offset, p.count});
      }
      bucket.name = "bucket " + std::to_string(b) + " (";
      for (std::size_t i = 0; i < bucket.params.size() && i < 3; ++i) {
        bucket.name += (i ? ", " : "") + params[static_cast<std::size_t>(bucket.params[i])].name;
      }
      bucket.name += bucket.params.size() > 3 ? ", ...)" : ")";
      bucket.pending = bucket.params.size();
    }
    buckets = std::move(fresh);
  }

  static void copy_floats(std::span<const float> from, std::size_t from_at, std::span<float> to,
                          std::size_t to_at, std::size_t count) {
    if (from.empty() || to.empty()) return;  // no such state (no feedback, no momentum)
    std::memcpy(to.data() + to_at, from.data() + from_at, count * sizeof(float));
  }

  // Error feedback's state of parameter `p`, or of its whole bucket (p null).
  compress::FeedbackState feedback_state(Bucket& b, const Param* p) {
    std::span<float> residual(b.residual), momentum(b.momentum);
    if (!p) return {residual, momentum};
    return {residual.subspan(p->offset, p->count),
            momentum.empty() ? momentum : momentum.subspan(p->offset, p->count)};
  }

  // Where the caller's gradients of a bucket's parameters tile one range of memory (a model's
  // flat gradient array, bucketed in reverse), the bucket reduces that range in place: no
  // copy in when a gradient is ready, none out after the reduction (the whole gradient each
  // way per step, docs/performance-notes.md). Otherwise the bucket keeps its own memory.
  void view_if_contiguous(Bucket& b) {
    std::vector<std::span<float>> spans;
    for (int id : b.params) {
      const Param& p = params[static_cast<std::size_t>(id)];
      if (p.external.empty() && p.count) return;
      if (p.count) spans.push_back(p.external);
    }
    if (spans.empty()) return;
    std::sort(spans.begin(), spans.end(),
              [](std::span<float> x, std::span<float> y) { return x.data() < y.data(); });
    for (std::size_t i = 1; i < spans.size(); ++i) {
      if (spans[i].data() != spans[i - 1].data() + spans[i - 1].size()) return;
    }
    b.view = {
        spans.front().data(),
        static_cast<std::size_t>(spans.back().data() + spans.back().size() - spans.front().data())};
  }

  // The step's first event (a mark_ready, or finish() if none came) starts its clock.
  void begin_step() {
    if (in_step) return;
    in_step = true;
    step_start = Clock::now();
    bytes_at_start = ctx.total_traffic().bytes_sent;
  }

  void ensure_built() {
    if (!buckets.empty() || params.empty()) return;
    std::vector<int> reverse;  // backward produces the last layers' gradients first
    for (int id = static_cast<int>(params.size()) - 1; id >= 0; --id) reverse.push_back(id);
    build(reverse);
  }

  std::span<float> slot(const Param& p) {
    return buckets[static_cast<std::size_t>(p.bucket)].values().subspan(p.offset, p.count);
  }

  // Queues, in bucket order, every bucket whose parameters are all ready.
  void launch_ready() {
    while (next_launch < buckets.size() && buckets[next_launch].pending == 0) {
      Bucket& b = buckets[next_launch];
      const collectives::CallSignature call{0,
                                            collectives::CollectiveKind::kCompressedAllreduce,
                                            DataType::kFloat32,
                                            ReduceOp::kAvg,
                                            Algorithm::kAuto,
                                            -1,
                                            b.values().size()};
      b.work = detail::ContextAccess::impl(ctx).submit_steps(
          call, [this, index = next_launch](CallSteps& steps) { reduce_bucket(steps, index); },
          false);
      ++next_launch;
    }
  }

  // Runs on the engine: the bucket's all-reduces, as steps of its call.
  void reduce_bucket(CallSteps& steps, std::size_t index) {
    Bucket& b = buckets[index];
    timeline::Span span("allreduce bucket " + std::to_string(index) + " (" +
                            std::to_string(b.values().size() * sizeof(float) >> 10) + " KiB, " +
                            codec->spec() + ")",
                        "comm");
    const auto t0 = Clock::now();
    b.calls = 0;
    if (whole_buckets) {
      const compress::FeedbackState state = feedback_state(b, nullptr);
      compress::compressed_allreduce_steps(steps, b.values(), *codec, b.name, b.parts,
                                           ReduceOp::kAvg, options.non_finite,
                                           feedback ? &state : nullptr);
      ++b.calls;
    } else {
      for (int id : b.params) {
        Param& p = params[static_cast<std::size_t>(id)];
        const compress::FeedbackState state = feedback_state(b, &p);
        compress::compressed_allreduce_steps(steps, slot(p), *codec,
                                             compress::Tensor(p.name, p.rows), ReduceOp::kAvg,
                                             options.non_finite, feedback ? &state : nullptr);
        ++b.calls;
      }
    }
    b.communication_s = seconds_between(t0, Clock::now());
  }

  // Two warnings DDP users would want (rank 0, once each, from the third communicating step:
  // the first builds, the second may follow a rebuild).
  void warn_if_needed(const StepStats& stats) {
    if (ctx.rank() != 0 || reductions < 2) return;
    const std::size_t per_call =
        stats.allreduce_calls ? stats.raw_bytes / stats.allreduce_calls : 0;
    if (!warned_small && stats.allreduce_calls > 4 && per_call < kSmallCallBytes) {
      warned_small = true;
      std::fprintf(stderr,
                   "gradsync reducer: %zu all-reduce calls of %zu KiB on average per step: "
                   "per-call latency dominates such small calls; raise bucket_bytes%s\n",
                   stats.allreduce_calls, per_call >> 10,
                   whole_buckets ? "" : " (this codec reduces parameter by parameter)");
    }
    if (!warned_exposed && options.overlap && stats.communication_s > 0 &&
        stats.overlap_fraction < 0.05) {
      warned_exposed = true;
      std::fprintf(stderr,
                   "gradsync reducer: communication is not overlapped with backward (%.0f%% "
                   "hidden): are gradients marked ready as backward produces them, and is the "
                   "first bucket small enough to launch early?\n",
                   100 * stats.overlap_fraction);
    }
  }

  Context& ctx;
  ReducerOptions options;
  std::unique_ptr<compress::Codec> codec;
  compress::ErrorFeedback* feedback;  // the codec, if it is error feedback: its state is ours
  const bool whole_buckets;
  bool warned_small = false, warned_exposed = false;
  // Calls below this carry too few bytes to amortise a collective's fixed cost: their bytes
  // take less time than the call's latency (docs/performance-notes.md).
  static constexpr std::size_t kSmallCallBytes = 64 << 10;
  std::vector<Param> params;
  std::vector<Bucket> buckets;

  // Step state (the backward thread's).
  bool in_step = false;
  Clock::time_point step_start;
  std::uint64_t bytes_at_start = 0;
  int micro_step = 0;            // accumulation steps since the last communication
  int reductions = 0;            // communicating steps so far
  std::vector<int> ready_order;  // first communicating step's, for the rebuild

  std::size_t next_launch = 0;  // the first bucket of this step not queued yet
};

Reducer::Reducer(Context& ctx, ReducerOptions options)
    : s_(std::make_unique<State>(ctx, std::move(options))) {}

Reducer::~Reducer() = default;

int Reducer::add_parameter(std::string name, std::size_t count, std::span<float> grad,
                           std::size_t rows) {
  if (!s_->buckets.empty()) {
    misuse(s_->ctx, "add_parameter('" + name +
                        "') after the first step: register every "
                        "parameter before training");
  }
  if (!grad.empty() && grad.size() != count) {
    misuse(s_->ctx, "parameter '" + name + "': gradient of " + std::to_string(grad.size()) +
                        " floats for a count of " + std::to_string(count));
  }
  for (const auto& p : s_->params) {
    if (p.name == name) misuse(s_->ctx, "parameter '" + name + "' registered twice");
  }
  State::Param p;
  p.name = std::move(name);
  p.count = count;
  p.rows = rows;
  p.external = grad;
  s_->params.push_back(std::move(p));
  return static_cast<int>(s_->params.size()) - 1;
}

std::span<float> Reducer::gradient(int id) {
  if (id < 0 || static_cast<std::size_t>(id) >= s_->params.size()) {
    misuse(s_->ctx, "no parameter " + std::to_string(id));
  }
  s_->ensure_built();
  State::Param& p = s_->params[static_cast<std::size_t>(id)];
  return p.external.empty() ? s_->slot(p) : p.external;
}

void Reducer::mark_ready(int id) {
  State& s = *s_;
  if (id < 0 || static_cast<std::size_t>(id) >= s.params.size()) {
    misuse(s.ctx, "mark_ready(" + std::to_string(id) + "): no such parameter");
  }
  s.ensure_built();
  State::Param& p = s.params[static_cast<std::size_t>(id)];
  if (p.ready) misuse(s.ctx, "parameter '" + p.name + "' marked ready twice in one step");
  p.ready = true;
  s.begin_step();
  if (!communicates()) return;
  if (s.reductions == 0 && s.options.rebuild_buckets) s.ready_order.push_back(id);
  State::Bucket& b = s.buckets[static_cast<std::size_t>(p.bucket)];
  if (!p.external.empty() && b.view.empty()) {
    timeline::Span span("pack " + p.name, "pack");
    std::memcpy(s.slot(p).data(), p.external.data(), p.count * sizeof(float));
  }
  if (--b.pending == 0 && s.options.overlap) s.launch_ready();
}

StepStats Reducer::finish() {
  State& s = *s_;
  s.ensure_built();
  StepStats stats;
  stats.buckets = s.buckets.size();
  s.begin_step();  // if nothing was marked ready, the step starts (and ends) here
  const auto called = Clock::now();
  stats.compute_s = seconds_between(s.step_start, called);
  s.in_step = false;
  if (!communicates()) {  // accumulation: gradients stay where they are
    ++s.micro_step;
    for (auto& p : s.params) p.ready = false;
    return stats;
  }
  // Parameters nobody marked: reduced as zeros, so every rank launches every bucket in the
  // same order; whether that was allowed is settled below, on every rank alike.
  std::vector<std::string> unused;
  for (auto& p : s.params) {
    if (p.ready) continue;
    unused.push_back(p.name);
    std::fill(s.slot(p).begin(), s.slot(p).end(), 0.0f);
    if (--s.buckets[static_cast<std::size_t>(p.bucket)].pending == 0 && s.options.overlap) {
      s.launch_ready();
    }
  }
  s.launch_ready();          // without overlap: everything now
  std::exception_ptr error;  // the first bucket's that failed
  {
    timeline::Span span("wait for buckets", "wait");
    for (auto& b : s.buckets) {
      try {
        b.work.wait();
      } catch (...) {
        if (!error) error = std::current_exception();
      }
      b.work = Work();
      stats.communication_s += b.communication_s;
      stats.allreduce_calls += b.calls;
      b.communication_s = 0;  // a call that never ran leaves these as they are
      b.calls = 0;
    }
  }
  const auto done = Clock::now();
  stats.exposed_s = seconds_between(called, done);
  for (auto& b : s.buckets) b.pending = b.params.size();
  for (auto& p : s.params) p.ready = false;
  s.next_launch = 0;
  // The order this step saw (kept only until the first reduction succeeds).
  const std::vector<int> observed = std::move(s.ready_order);
  s.ready_order.clear();
  s.micro_step = 0;
  if (error) std::rethrow_exception(error);
  // Did any rank leave a parameter unready (without find_unused_parameters)?
  std::int64_t unready =
      s.options.find_unused_parameters ? 0 : static_cast<std::int64_t>(unused.size());
  s.ctx.allreduce(&unready, &unready, 1, DataType::kInt64, ReduceOp::kMax);
  if (unready > 0) {
    std::string names;
    for (const auto& n : unused) names += (names.empty() ? "'" : ", '") + n + "'";
    throw Error(ErrorKind::kInvalidArgument,
                unused.empty() || s.options.find_unused_parameters
                    ? "another rank left parameters unready this step (set "
                      "find_unused_parameters if the model may skip some)"
                    : "parameters never marked ready this step: " + names +
                          " (set find_unused_parameters if the model may skip some)",
                s.ctx.rank(), Error::kNoPeer, "reducer finish");
  }
  {
    timeline::Span span("unpack", "pack");
    for (auto& p : s.params) {
      if (!p.external.empty() && s.buckets[static_cast<std::size_t>(p.bucket)].view.empty()) {
        std::memcpy(p.external.data(), s.slot(p).data(), p.count * 4);
      }
    }
  }
  for (const auto& p : s.params) stats.raw_bytes += p.count * sizeof(float);
  stats.communicated = true;
  stats.bytes_sent = s.ctx.total_traffic().bytes_sent - s.bytes_at_start;
  stats.overlap_fraction = stats.communication_s > 0
                               ? std::clamp(1.0 - stats.exposed_s / stats.communication_s, 0.0, 1.0)
                               : 0.0;
  s.warn_if_needed(stats);
  if (++s.reductions == 1 && s.options.rebuild_buckets) {
    // Rank 0's ready order, then whatever it never saw (unused there), last registered first.
    std::vector<std::int64_t> order(s.params.size(), -1);
    for (std::size_t i = 0; i < observed.size() && i < order.size(); ++i) order[i] = observed[i];
    s.ctx.broadcast(order.data(), order.size(), DataType::kInt64, 0);
    std::vector<int> chosen;
    std::vector<bool> seen(s.params.size(), false);
    for (std::int64_t id : order) {
      if (id >= 0 && !seen[static_cast<std::size_t>(id)]) {
        chosen.push_back(static_cast<int>(id));
        seen[static_cast<std::size_t>(id)] = true;
      }
    }
    for (int id = static_cast<int>(s.params.size()) - 1; id >= 0; --id) {
      if (!seen[static_cast<std::size_t>(id)]) chosen.push_back(id);
    }
    s.build(chosen);
  }
  return stats;
}

// "GSRD" v2: u32 rebuilt (0|1), u32 parameters, their ids in bucket order, the codec's own
// state, then per parameter (in id order) its name, and with error feedback its residual and
// momentum.
std::vector<std::uint8_t> Reducer::save_state() const {
  State& s = *s_;
  s.ensure_built();
  ByteWriter w("GSRD", kStateVersion);
  w.put<std::uint32_t>(s.reductions > 0 ? 1 : 0);
  w.put(static_cast<std::uint32_t>(s.params.size()));
  for (const auto& b : s.buckets) {
    for (int id : b.params) w.put(static_cast<std::uint32_t>(id));
  }
  w.bytes(s.codec->save_state());
  for (State::Param& p : s.params) {
    w.string(p.name);
    if (!s.feedback) continue;
    const compress::FeedbackState state =
        s.feedback_state(s.buckets[static_cast<std::size_t>(p.bucket)], &p);
    w.floats(state.residual);
    w.floats(state.momentum);
  }
  return w.take();
}

void Reducer::load_state(std::span<const std::uint8_t> state) {
  State& s = *s_;
  ByteReader r(state, "GSRD", kStateVersion, "reducer state");
  if (s.in_step || s.micro_step) r.fail("loaded in the middle of a step");
  const auto rebuilt = r.get<std::uint32_t>();
  const auto count = r.get<std::uint32_t>();
  if (count != s.params.size()) {
    r.fail(std::to_string(count) + " parameters, this reducer has " +
           std::to_string(s.params.size()));
  }
  std::vector<int> order(count);
  std::vector<bool> seen(count, false);
  for (std::uint32_t i = 0; i < count; ++i) {
    const auto id = r.get<std::uint32_t>();
    if (id >= count || seen[id]) r.fail("parameter order is not a permutation");
    seen[id] = true;
    order[i] = static_cast<int>(id);
  }
  const std::span<const std::uint8_t> codec_state = r.bytes();
  std::vector<std::vector<float>> residuals(count), momenta(count);
  for (std::uint32_t id = 0; id < count; ++id) {
    const State::Param& p = s.params[id];
    if (const std::string name = r.string(); name != p.name) {
      r.fail("parameter " + std::to_string(id) + " is '" + name + "' there and '" + p.name +
             "' here");
    }
    if (!s.feedback) continue;
    residuals[id] = r.floats();
    momenta[id] = r.floats();
    const std::size_t want_momentum = s.feedback->has_momentum() ? p.count : 0;
    if (residuals[id].size() != p.count || momenta[id].size() != want_momentum) {
      r.fail("parameter '" + p.name + "' has " + std::to_string(residuals[id].size()) +
             " residual and " + std::to_string(momenta[id].size()) + " momentum floats for " +
             std::to_string(p.count) + " elements");
    }
  }
  r.finish();
  s.codec->load_state(codec_state);  // may throw: nothing of ours replaced yet
  s.ensure_built();
  s.build(order);
  for (std::uint32_t id = 0; id < count && s.feedback; ++id) {
    State::Param& p = s.params[id];
    const compress::FeedbackState into =
        s.feedback_state(s.buckets[static_cast<std::size_t>(p.bucket)], &p);
    std::copy(residuals[id].begin(), residuals[id].end(), into.residual.begin());
    std::copy(momenta[id].begin(), momenta[id].end(), into.momentum.begin());
  }
  if (rebuilt) s.reductions = std::max(s.reductions, 1);  // no second rebuild
}

std::vector<std::vector<int>> Reducer::buckets() const {
  s_->ensure_built();
  std::vector<std::vector<int>> out;
  for (const auto& b : s_->buckets) out.push_back(b.params);
  return out;
}

std::span<const float> Reducer::held_back(int id) const {
  const State& s = *s_;
  if (id < 0 || static_cast<std::size_t>(id) >= s.params.size()) {
    misuse(s.ctx, "held_back(" + std::to_string(id) + "): no such parameter");
  }
  // Within a step the engine thread may be changing the residuals this would show.
  if (s.in_step) misuse(s.ctx, "held_back() inside a step: call it after finish()");
  const State::Param& p = s.params[static_cast<std::size_t>(id)];
  if (!s.feedback) return s.codec->held_back(p.name);  // PowerSGD keeps its own
  if (p.bucket < 0) return {};                         // before the first step
  return std::span<const float>(s.buckets[static_cast<std::size_t>(p.bucket)].residual)
      .subspan(p.offset, p.count);
}

std::string Reducer::codec_spec() const {
  return s_->codec->spec();
}

bool Reducer::communicates() const {
  return no_sync_depth_ == 0 && s_->micro_step + 1 >= s_->options.accumulate_steps;
}

}  // namespace gradsync
