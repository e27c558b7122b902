// Peer baseline: Gloo all-reduce (float32, sum) over its TCP transport, with the size sweep
// and timing rule of gradsync-bench. Gloo is what PyTorch's CPU ProcessGroupGloo runs.
//   gradsync-run -n 4 -- gloo_allreduce_bench --algo ring_chunked
//   mpirun -np 4 gloo_allreduce_bench            (MPI is used only to learn rank and size)

#include <gloo/allreduce.h>
#include <gloo/allreduce_bcube.h>
#include <gloo/allreduce_halving_doubling.h>
#include <gloo/allreduce_ring.h>
#include <gloo/allreduce_ring_chunked.h>
#include <gloo/barrier_all_to_all.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "sweep.h"

namespace {

constexpr const char* kUsage =
    "usage: gloo_allreduce_bench [options]\n"
    "Rank and size come from RANK/WORLD_SIZE (gradsync-run, torchrun) or\n"
    "OMPI_COMM_WORLD_RANK/SIZE (mpirun). Ranks meet through a gloo FileStore directory.\n"
    "  --algo A         allreduce (gloo::allreduce, ring; what PyTorch calls, default),\n"
    "                   allreduce_bcube, ring, ring_chunked, halving_doubling, bcube\n"
    "                   (the last four are gloo's algorithm classes, set up once per size)\n"
    "  --host H         address the TCP transport binds and advertises (default 127.0.0.1)\n"
    "  --store-dir D    rendezvous directory on a file system all ranks see (default\n"
    "                   /tmp/gloo-bench-<GRADSYNC_TOKEN or PMIX_NAMESPACE>; removed at exit)\n";

int env_int(const char* a, const char* b) {
  const char* v = std::getenv(a);
  if (!v) v = std::getenv(b);
  return v ? std::atoi(v) : -1;
}

std::string default_store_dir() {
  // A fresh directory per job: a FileStore never forgets keys, so a reused directory would
  // hand this job the addresses of a previous one.
  for (const char* var : {"GRADSYNC_TOKEN", "PMIX_NAMESPACE", "TORCHELASTIC_RUN_ID"}) {
    const char* v = std::getenv(var);
    if (v && *v) return std::string("/tmp/gloo-bench-") + v;
  }
  return "";
}

// One all-reduce of `count` floats at `buf`, in place, set up once and called many times.
class Runner {
 public:
  virtual ~Runner() = default;
  virtual void run() = 0;
};

// gloo's algorithm classes allocate their scratch buffers and register their pairs in the
// constructor, so timing run() alone measures steady state, as a framework that caches them
// would see. Held by pointer because gloo declares its algorithm destructors noexcept(false).
template <typename Algo>
class ClassRunner : public Runner {
 public:
  ClassRunner(const std::shared_ptr<gloo::Context>& ctx, float* buf, int count)
      : algo_(std::make_unique<Algo>(ctx, std::vector<float*>{buf}, count)) {}
  void run() override { algo_->run(); }

 private:
  std::unique_ptr<Algo> algo_;
};

// gloo::allreduce builds its options (and registers the buffer) on every call, as
// ProcessGroupGloo does.
class FunctionRunner : public Runner {
 public:
  FunctionRunner(std::shared_ptr<gloo::Context> ctx, float* buf, std::size_t count,
                 gloo::AllreduceOptions::Algorithm algo)
      : ctx_(std::move(ctx)), buf_(buf), count_(count), algo_(algo) {}
  void run() override {
    gloo::AllreduceOptions opts(ctx_);
    opts.setAlgorithm(algo_);
    opts.setOutput(buf_, count_);
    opts.setReduceFunction([](void* out, const void* a, const void* b, std::size_t n) {
      auto* o = static_cast<float*>(out);
      auto* x = static_cast<const float*>(a);
      auto* y = static_cast<const float*>(b);
      for (std::size_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
    });
    opts.setTag(tag_++);
    gloo::allreduce(opts);
  }

 private:
  std::shared_ptr<gloo::Context> ctx_;
  float* buf_;
  std::size_t count_;
  gloo::AllreduceOptions::Algorithm algo_;
  std::uint32_t tag_ = 0;
};

std::unique_ptr<Runner> make_runner(const std::string& algo,
                                    const std::shared_ptr<gloo::Context>& ctx, float* buf,
                                    std::size_t count) {
  const int n = static_cast<int>(count);
  if (algo == "allreduce") {
    return std::make_unique<FunctionRunner>(ctx, buf, count,
                                            gloo::AllreduceOptions::Algorithm::RING);
  }
  if (algo == "allreduce_bcube") {
    return std::make_unique<FunctionRunner>(ctx, buf, count,
                                            gloo::AllreduceOptions::Algorithm::BCUBE);
  }
  if (algo == "ring") return std::make_unique<ClassRunner<gloo::AllreduceRing<float>>>(ctx, buf, n);
  if (algo == "ring_chunked") {
    return std::make_unique<ClassRunner<gloo::AllreduceRingChunked<float>>>(ctx, buf, n);
  }
  if (algo == "halving_doubling") {
    return std::make_unique<ClassRunner<gloo::AllreduceHalvingDoubling<float>>>(ctx, buf, n);
  }
  if (algo == "bcube")
    return std::make_unique<ClassRunner<gloo::AllreduceBcube<float>>>(ctx, buf, n);
  return nullptr;
}

double reduce_over_ranks(const std::shared_ptr<gloo::Context>& ctx, double v,
                         const gloo::ReductionFunction<double>* fn) {
  gloo::AllreduceRing<double> r(ctx, std::vector<double*>{&v}, 1, fn);
  r.run();
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  peers::Sweep s;
  std::string algo = "allreduce", host = "127.0.0.1", store_dir = default_store_dir();
  const std::string usage = std::string(kUsage) + peers::kSweepUsage;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::fputs(usage.c_str(), stdout);
      return 0;
    }
    if (peers::parse_sweep_flag(argc, argv, i, s, "gloo_allreduce_bench", usage.c_str())) continue;
    if ((a == "--algo" || a == "--host" || a == "--store-dir") && i + 1 < argc) {
      (a == "--algo" ? algo : a == "--host" ? host : store_dir) = argv[++i];
    } else {
      peers::usage_error("gloo_allreduce_bench", "unknown option '" + a + "'", usage.c_str());
    }
  }
  if (s.label.empty()) s.label = "gloo-" + algo;
  const int rank = env_int("RANK", "OMPI_COMM_WORLD_RANK");
  const int n = env_int("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE");
  if (rank < 0 || n < 1 || rank >= n) {
    peers::usage_error("gloo_allreduce_bench", "set RANK and WORLD_SIZE (or run under mpirun)",
                       usage.c_str());
  }
  if (store_dir.empty()) {
    peers::usage_error("gloo_allreduce_bench", "no job id in the environment: give --store-dir",
                       usage.c_str());
  }
  const char* known[] = {"allreduce",    "allreduce_bcube",  "ring",
                         "ring_chunked", "halving_doubling", "bcube"};
  if (std::find(std::begin(known), std::end(known), algo) == std::end(known)) {
    peers::usage_error("gloo_allreduce_bench", "unknown --algo '" + algo + "'", usage.c_str());
  }

  try {
    std::filesystem::create_directories(store_dir);
    gloo::transport::tcp::attr attr;
    attr.hostname = host;
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore file_store(store_dir);
    gloo::rendezvous::PrefixStore store("allreduce-bench", file_store);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, n);
    ctx->setTimeout(std::chrono::seconds(120));
    ctx->connectFullMesh(store, dev);
    std::shared_ptr<gloo::Context> base = ctx;

    const std::size_t max_count = s.max_bytes / sizeof(float);
    gradsync::tools::PlacedBuffer<float> buf(max_count, s.offset);
    if (rank == 0) {
      peers::print_header("gloo_allreduce_bench", s, n, "gloo " + algo + ", tcp " + host);
    }
    std::vector<peers::Record> recs;
    std::uint64_t wrong_total = 0;
    for (std::size_t bytes : peers::sizes(s)) {
      const std::size_t count = bytes / sizeof(float);
      // gloo all-reduces in place; sums growing by a factor n per call are harmless for the
      // timing (no denormals arise from growth), and --check refills before its own call.
      peers::fill_input(buf.data(), count, rank);
      auto runner = make_runner(algo, base, buf.data(), count);
      for (int k = 0; k < s.warmup; ++k) runner->run();
      gloo::BarrierAllToAll(base).run();  // outside the timed loop: ranks start it together
      auto t0 = std::chrono::steady_clock::now();
      for (int k = 0; k < s.iters; ++k) runner->run();
      double per_call =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / s.iters;
      // The slowest rank defines the collective's time.
      per_call = reduce_over_ranks(base, per_call, gloo::ReductionFunction<double>::max);
      double wrong = 0;
      if (s.check) {
        peers::fill_input(buf.data(), count, rank);
        runner->run();
        wrong = static_cast<double>(peers::count_wrong_sum(buf.data(), count, n));
        wrong = reduce_over_ranks(base, wrong, gloo::ReductionFunction<double>::sum);
      }
      wrong_total += static_cast<std::uint64_t>(wrong);
      recs.push_back(peers::make_record(count, per_call, n, static_cast<std::uint64_t>(wrong)));
      if (rank == 0) peers::print_row(s, recs.back());
    }
    if (rank == 0 && !s.json.empty()) peers::write_json(s, recs, algo, "tcp", n);
    // The barrier keeps every rank's connections open until all results are in. A rank that
    // leaves it first closes its sockets, and gloo may report that close to a rank still
    // draining the barrier's last message: harmless here, the results are complete.
    try {
      gloo::BarrierAllToAll(base).run();
    } catch (const std::exception&) {
    }
    // Everyone is past the rendezvous; the directory is no longer read.
    if (rank == 0) std::filesystem::remove_all(store_dir);
    return wrong_total ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gloo_allreduce_bench: rank %d: %s\n", rank, e.what());
    // The job is failing anyway; do not leave its rendezvous files behind.
    std::error_code ignored;
    if (rank == 0) std::filesystem::remove_all(store_dir, ignored);
    return 1;
  }
}
