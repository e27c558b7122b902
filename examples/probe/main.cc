// gradsync-probe: measures what gradsync-advise needs to know of the cluster it runs on and
// writes it as a hardware profile. Run it under gradsync-run with the ranks a job would use:
// every rank computes, steps its optimizer and runs each codec at the same time as the others,
// so the figures include the ranks' competition for cores and memory. Links by ping-pong
// between rank 0 and a rank of its host and of another host; the reduction speed, and the
// links where the job has no such pair, from the context's start-up calibration
// (Context::cost_model()).
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "flag_numbers.h"
#include "gradsync/advise.h"
#include "gradsync/compress.h"
#include "gradsync/error.h"
#include "gradsync/gradsync.h"
#include "gradsync/optim.h"
#include "gradsync/version.h"
#include "train/model.h"

namespace {

constexpr const char* kUsage = R"(usage: gradsync-run -n N -- gradsync-probe [flags]
       gradsync-probe --version
  --model M      the trainer's model whose compute speed to measure (mlp, cnn)
  --hidden H,..  the MLP's hidden widths
  --batch B      samples per rank (64)
  --repeats R    timed repetitions of each measurement, median taken (10)
  --name TEXT    the profile's name (default: probed on HOST)
  --json FILE    rank 0 writes the profile to FILE (default: stdout)
)";

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "gradsync-probe: %s\n\n%s", message.c_str(), kUsage);
  std::exit(2);
}

struct Flags {
  std::string model = "mlp", name, json;
  std::size_t batch = 64;
  int repeats = 10;
};

Flags parse(int argc, char** argv) {
  Flags f;
  std::string hidden;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (flag == "--version") {
      std::printf("gradsync-probe %s\n", gradsync::version());
      std::exit(0);
    }
    if (i + 1 >= argc) usage_error(flag + " needs a value (or is unknown)");
    const std::string v = argv[++i];
    namespace flags = gradsync::flags;
    if (flag == "--model") {
      f.model = v;
    } else if (flag == "--hidden") {
      hidden = v;
    } else if (flag == "--name") {
      f.name = v;
    } else if (flag == "--json") {
      f.json = v;
    } else if (flag == "--batch") {
      f.batch = static_cast<std::size_t>(flags::integer(flag, v, 1, 1 << 20, usage_error));
    } else if (flag == "--repeats") {
      f.repeats = static_cast<int>(flags::integer(flag, v, 1, 1000, usage_error));
    } else {
      usage_error("unknown flag " + flag);
    }
  }
  if (!hidden.empty()) {
    if (f.model != "mlp") usage_error("--hidden is for --model mlp");
    f.model = "mlp:" + hidden;
  }
  return f;
}

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The median of `times`, the slowest rank's (the largest time, or with kMin the lowest speed).
double slowest_median(gradsync::Context& ctx, std::vector<double> times,
                      gradsync::ReduceOp op = gradsync::ReduceOp::kMax) {
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  double median = times[times.size() / 2];
  ctx.allreduce(&median, &median, 1, gradsync::DataType::kFloat64, op);
  return median;
}

// The median over `repeats` runs of `body`, every rank starting each run together; the
// slowest rank's, so that the profile describes the rank a synchronous step waits for.
double timed(gradsync::Context& ctx, int repeats, const std::function<void()>& body) {
  body();  // warm-up: first-touch page faults, caches, lazily built state
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    ctx.barrier();
    const auto t0 = Clock::now();
    body();
    times.push_back(since(t0));
  }
  return slowest_median(ctx, std::move(times));
}

// "alpha_us=0.87,bandwidth_gbps=10.7,..." -> the value of `key`, or `fallback`.
double constant(const std::string& model, const std::string& key, double fallback) {
  const std::string prefix = key + "=";
  std::size_t at = 0;
  while (at < model.size()) {
    const std::size_t end = std::min(model.find(',', at), model.size());
    if (model.compare(at, prefix.size(), prefix) == 0) {
      return std::strtod(model.substr(at + prefix.size(), end - at - prefix.size()).c_str(),
                         nullptr);
    }
    at = end + 1;
  }
  return fallback;
}

// How `compute` (compute_s alone) and some other work slow each other: `start(units, done)`
// begins `units` pieces of that work, of unit_s each alone, about as much as the compute, and
// returns what waits for them; `done` stamps their end. Each side's speed while both ran,
// relative to alone, the part of one that ran on after the other ended taken at full speed;
// medians over --repeats, the slowest rank's.
using Start = std::function<std::function<void()>(int units, std::function<void()> done)>;
std::pair<double, double> overlap_speeds(gradsync::Context& ctx, const Flags& f,
                                         const std::function<void()>& compute, double compute_s,
                                         double unit_s, const Start& start) {
  const int units = std::max(1, static_cast<int>(std::lround(compute_s / unit_s)));
  std::vector<double> compute_speeds, other_speeds;
  for (int r = 0; r < f.repeats; ++r) {
    ctx.barrier();
    const auto t0 = Clock::now();
    std::atomic<double> other_end{-1};
    const auto wait = start(units, [&] { other_end = since(t0); });
    compute();
    const double compute_end = since(t0);
    wait();
    while (other_end.load() < 0) std::this_thread::yield();  // `done` may follow the wake-up
    const double both = std::min(compute_end, other_end.load());
    const double other_work = units * unit_s - std::max(0.0, other_end - compute_end);
    const double compute_work = compute_s - std::max(0.0, compute_end - other_end);
    compute_speeds.push_back(std::clamp(compute_work / both, 0.05, 1.0));
    other_speeds.push_back(std::clamp(other_work / both, 0.05, 1.0));
  }
  return {slowest_median(ctx, compute_speeds, gradsync::ReduceOp::kMin),
          slowest_median(ctx, other_speeds, gradsync::ReduceOp::kMin)};
}

// Backward against bucket-sized all-reduces queued on the context's worker, and against a
// codec encoding on a thread of its own (as the worker runs a codec inside its calls).
void probe_overlap(gradsync::Context& ctx, const Flags& f, gradsync::advise::Profile& p,
                   const std::function<void()>& step, double step_s) {
  if (ctx.size() == 1) return;
  // Steps enough for 50 ms: a small model's step is over before a bucket's all-reduce starts.
  const int steps = std::max(1, static_cast<int>(std::ceil(0.05 / step_s)));
  const double compute_s = steps * step_s;
  const auto compute = [&] {
    for (int i = 0; i < steps; ++i) step();
  };
  constexpr std::size_t kFloats = std::size_t{4} << 20;  // a 16 MiB bucket
  std::vector<float> bucket(kFloats, 1.0f), sum(kFloats);
  const auto allreduce = [&] {
    return ctx.allreduce_async(bucket.data(), sum.data(), kFloats, gradsync::DataType::kFloat32,
                               gradsync::ReduceOp::kSum);
  };
  const double call_s = timed(ctx, f.repeats, [&] { allreduce().wait(); });
  std::tie(p.overlap_compute_speed, p.overlap_comm_speed) = overlap_speeds(
      ctx, f, compute, compute_s, call_s, [&](int calls, std::function<void()> done) {
        auto works = std::make_shared<std::vector<gradsync::Work>>();
        for (int i = 0; i < calls; ++i) works->push_back(allreduce());
        works->back().on_done(std::move(done));
        return [works] {
          for (auto& w : *works) w.wait();
        };
      });

  auto codec = gradsync::compress::make_codec("int8");  // error feedback: its heaviest pass
  const gradsync::compress::Tensor tensor("probe");
  std::vector<std::uint8_t> payload;
  const double encode_s = timed(ctx, f.repeats, [&] { codec->encode(tensor, bucket, payload); });
  std::tie(p.overlap_codec_compute_speed, p.overlap_codec_speed) = overlap_speeds(
      ctx, f, compute, compute_s, encode_s, [&](int encodes, std::function<void()> done) {
        auto encoder = std::make_shared<std::thread>([&, encodes, done] {
          for (int i = 0; i < encodes; ++i) codec->encode(tensor, bucket, payload);
          done();
        });
        return [encoder] { encoder->join(); };
      });
}

void probe_compute(gradsync::Context& ctx, const Flags& f, gradsync::advise::Profile& p) {
  const auto workload = gradsync::advise::model_workload(f.model, f.batch, "sgd");
  std::vector<std::size_t> hidden;
  if (f.model.rfind("mlp:", 0) == 0) {
    for (const auto& l : workload.layers) hidden.push_back(l.tensors.back().count);  // bias: width
    hidden.pop_back();                                                               // the classes
  }
  auto model = train::make_model(f.model.substr(0, 3), 1, hidden);
  std::mt19937 gen(static_cast<unsigned>(ctx.rank()));
  std::uniform_real_distribution<float> pixel(0.f, 1.f);
  std::vector<float> images(f.batch * 784);
  std::vector<std::uint8_t> labels(f.batch);
  for (auto& x : images) x = pixel(gen);
  for (auto& y : labels) y = static_cast<std::uint8_t>(gen() % 10);
  const auto compute = [&] {
    model->forward(images, f.batch);
    model->loss(labels, nullptr);
    model->backward(labels, false, {});
  };
  // The trainer's SGD: momentum 0.9, so the state is read and written too.
  auto sgd = gradsync::optim::make_sgd(model->values().size(), {.lr = 0.05f, .momentum = 0.9f});
  // Timed as the trainer runs them, one after the other: the optimizer's sweep over the
  // parameters, gradients and momenta leaves the caches cold for the next forward.
  std::vector<double> computes, steps;
  for (int r = 0; r <= f.repeats; ++r) {  // the first is a warm-up
    ctx.barrier();
    const auto t0 = Clock::now();
    compute();
    const auto t1 = Clock::now();
    sgd->step(model->values(), model->grads());
    if (r == 0) continue;
    computes.push_back(std::chrono::duration<double>(t1 - t0).count());
    steps.push_back(since(t1));
  }
  const double seconds = slowest_median(ctx, computes), step = slowest_median(ctx, steps);
  double flops = 0;
  for (const auto& l : workload.layers) flops += (l.forward_flops + l.backward_flops) * f.batch;
  p.compute_gflops = flops / seconds * 1e-9;
  p.optimizer_gbps = gradsync::advise::optimizer_bytes_per_parameter("sgd") *
                     static_cast<double>(model->values().size()) / step * 1e-9;
  probe_overlap(ctx, f, p, compute, seconds);
}

// Latency and bandwidth between rank 0 and `peer`: half a ping-pong of 8 bytes, and a
// message long enough (64 MiB) that a shaped link's burst allowance does not flatter it, as
// the start-up calibration's short messages can. Every rank takes part in the median's
// broadcast; the others only wait.
gradsync::advise::Link probe_link(gradsync::Context& ctx, const Flags& f, int peer) {
  constexpr std::size_t kLong = std::size_t{64} << 20;
  std::vector<unsigned char> small(8), big(kLong);
  const int me = ctx.rank();
  const bool in = me == 0 || me == peer;
  const int other = me == 0 ? peer : 0;
  const auto u8 = gradsync::DataType::kUInt8;
  // Back-to-back round trips, as a collective's messages follow each other: the first one
  // after the barrier may find the peer asleep.
  constexpr int kTrips = 200;
  const double round_trip = timed(ctx, f.repeats,
                                  [&] {
                                    for (int i = 0; in && i < kTrips; ++i) {
                                      if (me == 0) {
                                        ctx.send(small.data(), small.size(), u8, other);
                                        ctx.recv(small.data(), small.size(), u8, other);
                                      } else {
                                        ctx.recv(small.data(), small.size(), u8, other);
                                        ctx.send(small.data(), small.size(), u8, other);
                                      }
                                    }
                                  }) /
                            kTrips;
  // One-way transfers of `bytes` and an acknowledgement.
  const auto transfer = [&](std::size_t bytes, int repeats) {
    return timed(ctx, repeats, [&] {
      if (!in) return;
      if (me == 0) {
        ctx.send(big.data(), bytes, u8, other);
        ctx.recv(small.data(), 1, u8, other);  // the peer has it all
      } else {
        ctx.recv(big.data(), bytes, u8, other);
        ctx.send(small.data(), 1, u8, other);
      }
    });
  };
  // About half a second's worth, between 4 and 64 MiB: a slow link takes the probe minutes
  // otherwise. Every rank gets the same times (timed's maximum), so the same size.
  constexpr std::size_t kShort = std::size_t{4} << 20;
  const double estimate = kShort / transfer(kShort, 3);
  const std::size_t bytes = std::clamp(static_cast<std::size_t>(estimate * 0.5), kShort, kLong);
  const double one_way = transfer(bytes, std::max(3, f.repeats / 3));
  const double alpha_s = round_trip / 2;
  return {alpha_s * 1e6, bytes / std::max(one_way - round_trip, 1e-9) * 1e-9};
}

// float32 sum all-reduces from 4 KiB to 64 MiB over every rank, as the job will run them.
// float32 all-reduce, reduce-scatter and all-gather of 4 KiB to 64 MiB in all (every rank's
// share together), as the job will run them.
void probe_collectives(gradsync::Context& ctx, const Flags& f, gradsync::advise::Profile& p) {
  constexpr std::size_t kLargest = std::size_t{64} << 20;
  const auto n = static_cast<std::size_t>(ctx.size());
  const auto f32 = gradsync::DataType::kFloat32;
  // In place where the call allows, on data this rank has just written, as the Reducer
  // reduces a bucket that backward has filled: the same buffer reduced again and again stays
  // in cache and flatters large messages by a third.
  std::vector<float> data(kLargest / sizeof(float), 1.0f), out(data.size());
  using Call = std::function<void(std::size_t count)>;  // count: the whole vector's floats
  const std::pair<const char*, Call> calls[] = {
      {"allreduce",
       [&](std::size_t count) {
         ctx.allreduce(data.data(), data.data(), count, f32, gradsync::ReduceOp::kSum);
       }},
      {"reduce_scatter",
       [&](std::size_t count) {
         ctx.reduce_scatter(data.data(), out.data(), count / n, f32, gradsync::ReduceOp::kSum);
       }},
      {"allgather",
       [&](std::size_t count) { ctx.allgather(data.data(), out.data(), count / n, f32); }},
  };
  for (const auto& [name, call] : calls) {
    for (std::size_t bytes = 4096; bytes <= kLargest; bytes *= 4) {
      const std::size_t count = bytes / sizeof(float);
      std::vector<double> times;
      for (int r = 0; r <= f.repeats; ++r) {  // the first is a warm-up
        std::fill(data.begin(), data.begin() + static_cast<std::ptrdiff_t>(count), 1.0f);
        ctx.barrier();
        const auto t0 = Clock::now();
        call(count);
        if (r > 0) times.push_back(since(t0));
      }
      const double s = slowest_median(ctx, times);
      p.timed.push_back({name, ctx.size(), ctx.hosts(), bytes, s * 1e6});
      // Larger ones would take long on a slow link; the model scales the largest by size.
      if (s > 0.25) break;
    }
  }
}

// One rank's memcpy beyond the caches while every rank copies: the cost model's copy_gbps,
// which prices the memory traffic of large all-reduces.
void probe_copy(gradsync::Context& ctx, const Flags& f, gradsync::advise::Profile& p) {
  constexpr std::size_t kBytes = std::size_t{128} << 20;
  std::vector<unsigned char> from(kBytes, 1), to(kBytes, 2);
  const double seconds =
      timed(ctx, f.repeats, [&] { std::memcpy(to.data(), from.data(), kBytes); });
  p.copy_gbps = kBytes / seconds * 1e-9;
}

// Each codec at two tensor sizes, a matrix of 1 Mi floats and one of 16 Mi: top-k's selection
// and the caches make the speed per byte fall with the size (the advisor interpolates).
void probe_codecs(gradsync::Context& ctx, const Flags& f, gradsync::advise::Profile& p) {
  std::mt19937 gen(static_cast<unsigned>(ctx.rank()) + 1);
  std::normal_distribution<float> normal;
  const auto names = gradsync::compress::codec_names();
  const auto specs = gradsync::compress::codec_examples();
  for (const std::size_t rows : {std::size_t{1024}, std::size_t{4096}}) {
    const std::size_t floats = rows * rows;
    std::vector<float> gradient(floats), decoded(floats);
    for (auto& g : gradient) g = normal(gen);
    const double bytes = static_cast<double>(floats * sizeof(float));
    const auto time = [&](const std::string& key, const std::string& spec) {
      auto codec = gradsync::compress::make_codec(spec);
      const gradsync::compress::Tensor tensor("probe", rows);
      std::vector<std::uint8_t> payload;
      gradsync::advise::Profile::CodecSpeed speed;
      speed.floats = floats;
      speed.encode_gbps =
          bytes / timed(ctx, f.repeats, [&] { codec->encode(tensor, gradient, payload); }) * 1e-9;
      speed.decode_gbps =
          bytes / timed(ctx, f.repeats, [&] { codec->decode_add(payload, decoded); }) * 1e-9;
      p.codecs[key].push_back(speed);
    };
    for (std::size_t i = 0; i < names.size(); ++i) {
      time(names[i], specs[i]);
      // A quantised ring re-encodes at every hop without error feedback: that speed too.
      if (gradsync::compress::make_codec(specs[i])->traits().pattern ==
          gradsync::compress::Pattern::kQuantizedRing) {
        auto raw = gradsync::compress::CodecSpec::parse(specs[i]);
        raw.params["ef"] = 0;
        time(names[i] + ":ef=0", raw.to_string());
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Flags flags = parse(argc, argv);
  try {
    auto ctx = gradsync::init();
    gradsync::advise::Profile p;
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    p.name = flags.name.empty() ? std::string("probed on ") + host : flags.name;
    p.sources = {"gradsync-probe --model " + flags.model + " --batch " +
                 std::to_string(flags.batch) + ", " + std::to_string(ctx->size()) + " ranks on " +
                 std::to_string(ctx->hosts()) +
                 " hosts: links by ping-pong, the rest timed "
                 "with every rank at work; reduction speed from the context's start-up "
                 "calibration (" +
                 ctx->cost_model() + ")"};
    cpu_set_t usable;
    p.cores_per_host = ::sched_getaffinity(0, sizeof usable, &usable) == 0 ? CPU_COUNT(&usable) : 1;
    const std::string costs = ctx->cost_model();
    p.intra = {constant(costs, "alpha_us", p.intra.alpha_us),
               constant(costs, "bandwidth_gbps", p.intra.bandwidth_gbps)};
    // Measured where the job has such a pair: rank 0's host-mate, and the first rank on
    // another host; else the calibration's (intra) figure stands for both.
    int mate = -1, remote = -1;
    for (int r = ctx->size() - 1; r > 0; --r) {
      (ctx->host_of(r) == ctx->host_of(0) ? mate : remote) = r;
    }
    if (mate > 0) p.intra = probe_link(*ctx, flags, mate);
    p.inter = remote > 0 ? probe_link(*ctx, flags, remote) : p.intra;
    p.reduce_gbps = constant(costs, "reduce_gbps", p.reduce_gbps);
    probe_copy(*ctx, flags, p);
    if (ctx->size() > 1) probe_collectives(*ctx, flags, p);
    probe_compute(*ctx, flags, p);
    probe_codecs(*ctx, flags, p);
    if (ctx->rank() == 0) {
      const std::string text = gradsync::advise::profile_json(p);
      if (flags.json.empty()) {
        std::fputs(text.c_str(), stdout);
      } else {
        std::ofstream out(flags.json);
        out << text;
        if (!out) {
          std::fprintf(stderr, "gradsync-probe: cannot write %s\n", flags.json.c_str());
          return 1;
        }
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gradsync-probe: %s\n", e.what());
    return 1;
  }
  return 0;
}
