// gradsync-probe: measures what gradsync-advise needs to know of the cluster it runs on and
// writes it as a hardware profile. Run it under gradsync-run with the ranks a job would use:
// every rank computes, steps its optimizer and runs each codec at the same time as the others,
// so the figures include the ranks' competition for cores and memory. Links: the cost-model
// constants the context measured at start-up (Context::cost_model()).
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "gradsync/advise.h"
#include "gradsync/compress.h"
#include "gradsync/error.h"
#include "gradsync/gradsync.h"
#include "gradsync/optim.h"
#include "train/model.h"

namespace {

constexpr const char* kUsage = R"(usage: gradsync-run -n N -- gradsync-probe [flags]
  --model M      the trainer's model whose compute speed to measure (mlp; mlp:H1,..; cnn)
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
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (i + 1 >= argc) usage_error(flag + " needs a value (or is unknown)");
    const std::string v = argv[++i];
    if (flag == "--model")
      f.model = v;
    else if (flag == "--name")
      f.name = v;
    else if (flag == "--json")
      f.json = v;
    else if (flag == "--batch")
      f.batch = std::strtoul(v.c_str(), nullptr, 10);
    else if (flag == "--repeats")
      f.repeats = std::atoi(v.c_str());
    else
      usage_error("unknown flag " + flag);
  }
  if (f.batch < 1 || f.repeats < 1) usage_error("--batch and --repeats must be at least 1");
  return f;
}

// The median over `repeats` runs of `body`, every rank starting each run together; the
// slowest rank's, so that the profile describes the rank a synchronous step waits for.
double timed(gradsync::Context& ctx, int repeats, const std::function<void()>& body) {
  body();  // warm-up: first-touch page faults, caches, lazily built state
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    ctx.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    body();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(times.begin(), times.begin() + repeats / 2, times.end());
  double median = times[static_cast<std::size_t>(repeats / 2)];
  ctx.allreduce(&median, &median, 1, gradsync::DataType::kFloat64, gradsync::ReduceOp::kMax);
  return median;
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

void probe_compute(gradsync::Context& ctx, const Flags& f, gradsync::advise::Profile& p) {
  const auto workload = gradsync::advise::model_workload(f.model, f.batch, "sgd");
  std::vector<std::size_t> hidden;
  if (f.model.rfind("mlp:", 0) == 0) {
    for (const auto& l : workload.layers) hidden.push_back(l.tensors.back());  // bias: width
    hidden.pop_back();                                                         // the classes
  }
  auto model = train::make_model(f.model.substr(0, 3), 1, hidden);
  std::mt19937 gen(static_cast<unsigned>(ctx.rank()));
  std::uniform_real_distribution<float> pixel(0.f, 1.f);
  std::vector<float> images(f.batch * 784);
  std::vector<std::uint8_t> labels(f.batch);
  for (auto& x : images) x = pixel(gen);
  for (auto& y : labels) y = static_cast<std::uint8_t>(gen() % 10);
  const double seconds = timed(ctx, f.repeats, [&] {
    model->forward(images, f.batch);
    model->loss(labels, nullptr);
    model->backward(labels, false, {});
  });
  double flops = 0;
  for (const auto& l : workload.layers) flops += (l.forward_flops + l.backward_flops) * f.batch;
  p.compute_gflops = flops / seconds * 1e-9;

  auto sgd = gradsync::optim::make_sgd(model->values().size());
  const double step = timed(ctx, f.repeats, [&] { sgd->step(model->values(), model->grads()); });
  p.optimizer_gbps = gradsync::advise::optimizer_bytes_per_parameter("sgd") *
                     static_cast<double>(model->values().size()) / step * 1e-9;
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

void probe_codecs(gradsync::Context& ctx, const Flags& f, gradsync::advise::Profile& p) {
  constexpr std::size_t kRows = 2048, kFloats = kRows * kRows;  // 16 MiB: beyond the caches
  std::vector<float> gradient(kFloats), decoded(kFloats);
  std::mt19937 gen(static_cast<unsigned>(ctx.rank()) + 1);
  std::normal_distribution<float> normal;
  for (auto& g : gradient) g = normal(gen);
  const double bytes = kFloats * sizeof(float);
  const auto names = gradsync::compress::codec_names();
  const auto specs = gradsync::compress::codec_examples();
  for (std::size_t i = 0; i < names.size(); ++i) {
    const std::string& name = names[i];
    auto codec = gradsync::compress::make_codec(specs[i]);
    const gradsync::compress::Tensor tensor("probe", kRows);
    std::vector<std::uint8_t> payload;
    p.encode_gbps[name] =
        bytes / timed(ctx, f.repeats, [&] { codec->encode(tensor, gradient, payload); }) * 1e-9;
    p.decode_gbps[name] =
        bytes / timed(ctx, f.repeats, [&] { codec->decode_add(payload, decoded); }) * 1e-9;
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
                 " hosts; links: the context's start-up "
                 "calibration (" +
                 ctx->cost_model() + ")"};
    cpu_set_t usable;
    p.cores_per_host = ::sched_getaffinity(0, sizeof usable, &usable) == 0 ? CPU_COUNT(&usable) : 1;
    const std::string costs = ctx->cost_model();
    p.intra = {constant(costs, "alpha_us", p.intra.alpha_us),
               constant(costs, "bandwidth_gbps", p.intra.bandwidth_gbps)};
    p.inter = {constant(costs, "inter_alpha_us", p.intra.alpha_us),
               constant(costs, "inter_bandwidth_gbps", p.intra.bandwidth_gbps)};
    p.reduce_gbps = constant(costs, "reduce_gbps", p.reduce_gbps);
    p.copy_gbps = constant(costs, "copy_gbps", p.copy_gbps);
    probe_copy(*ctx, flags, p);
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
