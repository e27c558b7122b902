// gradsync-train: data-parallel training of an MLP or a small CNN on Fashion-MNIST, one
// process per rank (start it with gradsync-run), with every lever of the library on a flag:
// the codec, the buckets, overlap, accumulation, ZeRO, the optimizer.
//
//   gradsync-run -n 4 -- gradsync-train --model mlp --epochs 2 --codec fp16 --json run.json
#include <fcntl.h>
#include <gradsync/compress.h>
#include <gradsync/gradsync.h>
#include <gradsync/optim.h>
#include <gradsync/reducer.h>
#include <gradsync/timeline.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <numbers>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "train/fashion_mnist.h"
#include "train/model.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kUsage =
    "usage: gradsync-train [options]   (one process per rank: run it under gradsync-run)\n"
    "  --model mlp|cnn        the network (default mlp: 784-2048x4-10, 14.2 M parameters)\n"
    "  --hidden A,B,...       the MLP's hidden widths (default 2048,2048,2048,2048)\n"
    "  --epochs N             passes over the training set (default 1)\n"
    "  --batch B              samples per rank per micro-batch (default 64)\n"
    "  --lr X                 learning rate (default 0.05 sgd, 0.001 adamw)\n"
    "  --lr-schedule S        constant (default) or cosine: lr (1 + cos(pi t / T)) / 2 at step\n"
    "                         t of T, as torch's CosineAnnealingLR to zero\n"
    "  --optimizer sgd|adamw  (default sgd, momentum 0.9; none when the codec has momentum=M)\n"
    "  --seed S               weights and data order (default 1)\n"
    "  --codec SPEC           gradient codec (default none; fp16, int8, topk:ratio=0.01, ...)\n"
    "  --bucket-mb X          bucket size (default 25)\n"
    "  --first-bucket-mb X    first bucket size (default 1)\n"
    "  --no-overlap           all-reduce only after backward, for comparison\n"
    "  --step-ahead 0|1       with a codec that holds gradient back (error feedback) and SGD,\n"
    "                         compute gradients at value - lr * held back (default 1)\n"
    "  --accumulate K         K micro-batches per optimizer step, communicating once\n"
    "  --zero 0|1|2           ZeRO stage (1, 2: sharded optimizer state / gradients)\n"
    "  --max-steps N          stop after N optimizer steps (benchmarks; default: all)\n"
    "  --data DIR             Fashion-MNIST IDX files (default /usr/share/datasets/fashion-mnist)\n"
    "  --json FILE            rank 0 writes the run's metrics and configuration to FILE\n"
    "  --checkpoint DIR       save model, optimizer, codec and data position to DIR (each\n"
    "                         rank its file, written atomically; DIR/LATEST names the step)\n"
    "  --checkpoint-every N   every N steps (default: at the end of each epoch)\n"
    "  --resume               continue from DIR/LATEST (same ranks and flags), with the\n"
    "                         cost model the checkpoint's run chose algorithms by\n"
    "  --quiet                no progress bar\n";

struct Config {
  std::string model = "mlp";
  std::vector<std::size_t> hidden;
  int epochs = 1;
  std::size_t batch = 64;
  double lr = -1;
  bool cosine = false;
  std::string optimizer = "sgd";
  std::uint64_t seed = 1;
  std::string codec = "none";
  double bucket_mb = 25, first_bucket_mb = 1;
  bool overlap = true;
  bool step_ahead = true;
  int accumulate = 1;
  int zero = 0;
  long max_steps = -1;
  std::string data = train::kFashionMnistDir;
  std::string json;
  bool quiet = false;
  std::string checkpoint;
  long checkpoint_every = 0;  // 0: end of each epoch
  bool resume = false;
};

[[noreturn]] void usage_error(const std::string& what) {
  std::fprintf(stderr, "gradsync-train: %s\n%s", what.c_str(), kUsage);
  std::exit(2);
}

// Step-ahead error feedback (Xu et al., AAAI 2021): the residual this rank holds back is
// gradient the model will still move by, about lr * residual, once the wire carries it. A
// gradient computed where the model stands lags that move; computed at value - lr * residual
// it is one for where the model is headed. On the Fashion-MNIST MLP this takes top-k at 1%
// from 0.96 to 0.19 points behind float32 under a cosine schedule (BENCHMARKS.md). The training
// loss reported is the one there too. Keeps every value in `saved` for look_back; false (nothing
// moved) when nothing is held back.
bool look_ahead(const gradsync::Reducer& reducer, train::Model& model, float lr,
                std::vector<float>& saved) {
  saved.clear();
  std::vector<train::Parameter>& params = model.parameters();
  for (std::size_t id = 0; id < params.size(); ++id) {
    const std::span<const float> held = reducer.held_back(static_cast<int>(id));
    if (held.empty()) continue;
    if (saved.empty()) saved.assign(model.values().begin(), model.values().end());
    std::span<float> value = params[id].value;
    for (std::size_t i = 0; i < value.size(); ++i) value[i] -= lr * held[i];
  }
  return !saved.empty();
}

// Puts back the values look_ahead moved, bit for bit: each rank moved them by its own
// residual, and every rank must take the optimizer step from the same values.
void look_back(train::Model& model, const std::vector<float>& saved) {
  std::memcpy(model.values().data(), saved.data(), saved.size() * sizeof(float));
}

// A codec with momentum correction (DGC) applies SGD's momentum before the wire: what arrives
// is already the update, so the optimizer must not apply momentum again.
bool codec_has_momentum(const std::string& spec) {
  return gradsync::compress::CodecSpec::parse(spec).get("momentum", 0) > 0;
}

double number(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || !std::isfinite(x))
    usage_error(flag + ": '" + v + "' is not a number");
  return x;
}

long whole(const std::string& flag, const std::string& v, long low) {
  const double x = number(flag, v);
  if (x != std::floor(x) || x < static_cast<double>(low)) {
    usage_error(flag + ": '" + v + "' is not a whole number >= " + std::to_string(low));
  }
  return static_cast<long>(x);
}

Config parse(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--model") {
      c.model = value();
      if (c.model != "mlp" && c.model != "cnn") usage_error("--model is mlp or cnn");
    } else if (a == "--hidden") {
      std::stringstream in(value());
      for (std::string w; std::getline(in, w, ',');) {
        c.hidden.push_back(static_cast<std::size_t>(whole("--hidden", w, 1)));
      }
    } else if (a == "--epochs") {
      c.epochs = static_cast<int>(whole(a, value(), 1));
    } else if (a == "--batch") {
      c.batch = static_cast<std::size_t>(whole(a, value(), 1));
    } else if (a == "--lr") {
      c.lr = number(a, value());
    } else if (a == "--lr-schedule") {
      const std::string v = value();
      if (v != "constant" && v != "cosine") usage_error("--lr-schedule is constant or cosine");
      c.cosine = v == "cosine";
    } else if (a == "--optimizer") {
      c.optimizer = value();
      if (c.optimizer != "sgd" && c.optimizer != "adamw")
        usage_error("--optimizer is sgd or adamw");
    } else if (a == "--seed") {
      c.seed = static_cast<std::uint64_t>(whole(a, value(), 0));
    } else if (a == "--codec") {
      c.codec = value();
    } else if (a == "--bucket-mb") {
      c.bucket_mb = number(a, value());
    } else if (a == "--first-bucket-mb") {
      c.first_bucket_mb = number(a, value());
    } else if (a == "--no-overlap") {
      c.overlap = false;
    } else if (a == "--step-ahead") {
      const std::string v = value();
      if (v != "0" && v != "1") usage_error("--step-ahead is 0 or 1");
      c.step_ahead = v == "1";
    } else if (a == "--accumulate") {
      c.accumulate = static_cast<int>(whole(a, value(), 1));
    } else if (a == "--zero") {
      c.zero = static_cast<int>(whole(a, value(), 0));
      if (c.zero > 2) usage_error("--zero is 0, 1 or 2");
    } else if (a == "--max-steps") {
      c.max_steps = whole(a, value(), 1);
    } else if (a == "--data") {
      c.data = value();
    } else if (a == "--json") {
      c.json = value();
    } else if (a == "--quiet") {
      c.quiet = true;
    } else if (a == "--checkpoint") {
      c.checkpoint = value();
    } else if (a == "--checkpoint-every") {
      c.checkpoint_every = whole(a, value(), 1);
    } else if (a == "--resume") {
      c.resume = true;
    } else if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else {
      usage_error("unknown option '" + a + "'");
    }
  }
  if (c.lr < 0) c.lr = c.optimizer == "adamw" ? 0.001 : 0.05;
  if (c.bucket_mb <= 0 || c.first_bucket_mb <= 0) usage_error("bucket sizes must be positive");
  if ((c.resume || c.checkpoint_every) && c.checkpoint.empty()) {
    usage_error("--resume and --checkpoint-every need --checkpoint DIR");
  }
  if (c.optimizer != "sgd" && codec_has_momentum(c.codec)) {
    usage_error("a codec with momentum= takes the place of SGD's momentum: use --optimizer sgd");
  }
  if (c.zero > 0 && c.codec != "none") {
    usage_error("--zero 1|2 reduce-scatters float32 gradients: use --codec none with it");
  }
  return c;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    if (ch == '"' || ch == '\\') o += '\\';
    o += ch;
  }
  return o;
}

// Totals over a run, for the summary and the JSON.
struct Totals {
  double compute_s = 0, communication_s = 0, exposed_s = 0, step_s = 0;
  std::uint64_t bytes_sent = 0, raw_bytes = 0;
  std::size_t allreduce_calls = 0, steps = 0, samples = 0;
  double last_loss = 0;
};

// Test accuracy: each rank scores a contiguous share of the test set; the counts are summed.
double evaluate(gradsync::Context& ctx, train::Model& model, const train::Dataset& test,
                std::size_t batch) {
  const auto n = static_cast<std::size_t>(ctx.size()), r = static_cast<std::size_t>(ctx.rank());
  const std::size_t first = test.count * r / n, last = test.count * (r + 1) / n;
  std::int64_t counts[2] = {0, static_cast<std::int64_t>(last - first)};
  const std::size_t pixels = test.rows * test.cols;
  for (std::size_t at = first; at < last; at += batch) {
    const std::size_t b = std::min(batch, last - at);
    model.forward({test.images.data() + at * pixels, b * pixels}, b);
    std::size_t correct = 0;
    model.loss({test.labels.data() + at, b}, &correct);
    counts[0] += static_cast<std::int64_t>(correct);
  }
  ctx.allreduce(counts, counts, 2, gradsync::DataType::kInt64, gradsync::ReduceOp::kSum);
  return counts[1] ? static_cast<double>(counts[0]) / static_cast<double>(counts[1]) : 0.0;
}

void progress(const Config& c, int epoch, std::size_t step, std::size_t steps, float loss,
              double accuracy, double samples_per_s, const Totals& t) {
  constexpr int kWidth = 24;
  const int filled = static_cast<int>(kWidth * (step + 1) / std::max<std::size_t>(1, steps));
  const double comm = t.step_s > 0 ? 100.0 * t.communication_s / t.step_s : 0;
  const double overlap =
      t.communication_s > 0 ? 100.0 * std::max(0.0, 1.0 - t.exposed_s / t.communication_s) : 0;
  std::fprintf(stderr,
               "\repoch %d/%d [%s%s] step %zu/%zu loss %.4f acc %5.1f%% %7.0f samples/s "
               "comm %3.0f%% overlap %3.0f%%",
               epoch + 1, c.epochs, std::string(static_cast<std::size_t>(filled), '#').c_str(),
               std::string(static_cast<std::size_t>(kWidth - filled), '.').c_str(), step + 1, steps,
               static_cast<double>(loss), 100 * accuracy, samples_per_s, comm, overlap);
}

// --- checkpoints: one file per rank (its optimizer shard and codec state are its own), each
// written to a temporary file, fsynced and renamed; then rank 0 names the step in LATEST the
// same way. A crash at any point leaves LATEST naming a complete earlier set.

void put(std::vector<std::uint8_t>& out, const void* p, std::size_t n) {
  const std::size_t at = out.size();
  out.resize(at + n);
  if (n) std::memcpy(out.data() + at, p, n);  // (GCC 12 misreads vector::insert here)
}
void put_blob(std::vector<std::uint8_t>& out, std::span<const std::uint8_t> blob) {
  const std::uint64_t n = blob.size();
  put(out, &n, 8);
  put(out, blob.data(), blob.size());
}

struct Reader {
  std::span<const std::uint8_t> in;
  std::string path;
  std::size_t at = 0;
  void take(void* p, std::size_t n) {
    if (in.size() - at < n) throw std::runtime_error(path + ": truncated checkpoint");
    std::memcpy(p, in.data() + at, n);
    at += n;
  }
  std::span<const std::uint8_t> blob() {
    std::uint64_t n;
    take(&n, 8);
    if (in.size() - at < n) throw std::runtime_error(path + ": truncated checkpoint");
    auto b = in.subspan(at, n);
    at += n;
    return b;
  }
};

void write_atomically(const std::string& path, std::span<const std::uint8_t> bytes,
                      bool crash_before_rename) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw std::runtime_error("cannot write " + tmp + ": " + std::strerror(errno));
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      ::close(fd);
      throw std::runtime_error("cannot write " + tmp + ": " + std::strerror(errno));
    }
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    throw std::runtime_error("cannot sync " + tmp + ": " + std::strerror(errno));
  }
  if (crash_before_rename) std::abort();  // tests: a crash in the middle of a save
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    throw std::runtime_error("cannot rename " + tmp + ": " + std::strerror(errno));
  }
  const std::string dir = path.substr(0, path.find_last_of('/') + 1);
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {  // the rename itself durable
    ::fsync(dfd);
    ::close(dfd);
  }
}

std::vector<std::uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path + ": " + std::strerror(errno));
  return std::vector<std::uint8_t>(std::istreambuf_iterator<char>(f), {});
}

std::string rank_file(const std::string& dir, long step, int rank) {
  return dir + "/step-" + std::to_string(step) + ".rank-" + std::to_string(rank) + ".ckpt";
}

// Where training stands: the next step to run.
struct Position {
  long steps_done = 0;
  int epoch = 0;
  std::size_t step = 0;
};

// The cost model a checkpoint's run chose its algorithms with (see save): a resumed run
// that measured the machine again could choose others, whose float32 sums round differently.
std::string cost_model_file(const std::string& dir) {
  return dir + "/COST_MODEL";
}

int run(const Config& c) {
  if (c.resume && !std::getenv("GRADSYNC_COST_MODEL") &&
      std::filesystem::exists(cost_model_file(c.checkpoint))) {
    const auto saved = read_file(cost_model_file(c.checkpoint));
    ::setenv("GRADSYNC_COST_MODEL", std::string(saved.begin(), saved.end()).c_str(), 1);
  }
  auto ctx = gradsync::init();
  const int rank = ctx->rank(), world = ctx->size();
  const bool talk = rank == 0 && !c.quiet;
  const train::Dataset train_set = train::load_fashion_mnist(c.data, true);
  const train::Dataset test_set = train::load_fashion_mnist(c.data, false);
  auto model = train::make_model(c.model, c.seed, c.hidden);
  std::vector<train::Parameter>& params = model->parameters();
  const std::size_t total = model->values().size();

  gradsync::ReducerOptions ro;
  ro.codec = c.codec;
  ro.bucket_bytes = static_cast<std::size_t>(c.bucket_mb * (1 << 20));
  ro.first_bucket_bytes = static_cast<std::size_t>(c.first_bucket_mb * (1 << 20));
  ro.overlap = c.overlap;
  ro.accumulate_steps = c.accumulate;
  std::optional<gradsync::Reducer> reducer;
  if (c.zero == 0) {
    reducer.emplace(*ctx, ro);
    for (auto& p : params) reducer->add_parameter(p.name, p.count, p.grad, p.rows);
  }
  auto make_optimizer = [&](std::size_t count) -> std::unique_ptr<gradsync::optim::Optimizer> {
    if (c.optimizer == "adamw") {
      return gradsync::optim::make_adamw(count, {.lr = static_cast<float>(c.lr)});
    }
    return gradsync::optim::make_sgd(
        count,
        {.lr = static_cast<float>(c.lr), .momentum = codec_has_momentum(c.codec) ? 0.0f : 0.9f});
  };
  // ZeRO 0 with the reducer: the gradients arrive averaged, every rank updates everything.
  std::unique_ptr<gradsync::optim::Optimizer> optimizer;
  std::optional<gradsync::optim::ZeroOptimizer> zero;
  if (c.zero == 0) {
    optimizer = make_optimizer(total);
  } else {
    zero.emplace(*ctx, total, c.zero, make_optimizer);
  }

  train::ShardedSampler sampler(train_set.count, rank, world, c.batch, c.seed);
  const std::size_t micro_per_epoch = sampler.steps_per_epoch();
  const std::size_t steps_per_epoch = micro_per_epoch / static_cast<std::size_t>(c.accumulate);
  if (steps_per_epoch == 0) throw std::runtime_error("an epoch holds no full step: lower --batch");
  // The learning rate of optimizer step `step` (0-based): a function of the step alone, so a
  // resumed run continues the schedule without saving it.
  long total_steps = static_cast<long>(steps_per_epoch) * c.epochs;
  if (c.max_steps >= 0) total_steps = std::min(total_steps, c.max_steps);
  auto lr_at = [&](long step) {
    if (!c.cosine) return static_cast<float>(c.lr);
    return static_cast<float>(c.lr * 0.5 *
                              (1 + std::cos(std::numbers::pi * static_cast<double>(step) /
                                            static_cast<double>(std::max(total_steps, 1L)))));
  };
  // lr * residual is how far plain SGD (with or without momentum) will still move; AdamW
  // scales each element by its own statistics, so the move is unknown.
  const bool step_ahead = reducer && c.step_ahead && c.optimizer == "sgd";
  std::vector<float> saved;  // the values before look_ahead

  auto save = [&](const Position& at, int saves) {
    std::filesystem::create_directories(c.checkpoint);
    std::vector<std::uint8_t> out;
    put(out, "GSTC", 4);
    const std::uint64_t header[6] = {1,
                                     static_cast<std::uint64_t>(world),
                                     total,
                                     static_cast<std::uint64_t>(at.steps_done),
                                     static_cast<std::uint64_t>(at.epoch),
                                     at.step};
    put(out, header, sizeof header);
    const std::span<const float> values = model->values();
    put_blob(out, {reinterpret_cast<const std::uint8_t*>(values.data()), values.size_bytes()});
    put_blob(out, zero ? zero->save_state() : optimizer->save_state());
    put_blob(out, reducer ? reducer->save_state() : std::vector<std::uint8_t>());
    const char* crash = std::getenv("GRADSYNC_TRAIN_CRASH_AT_SAVE");  // tests only
    const bool crash_now = crash && rank == 0 && std::atoi(crash) == saves;
    write_atomically(rank_file(c.checkpoint, at.steps_done, rank), out, crash_now);
    ctx->barrier();  // every rank's file is in place before LATEST names the step
    if (rank == 0) {
      const std::string cost_model = ctx->cost_model();  // rank 0's, which every rank uses
      write_atomically(
          cost_model_file(c.checkpoint),
          {reinterpret_cast<const std::uint8_t*>(cost_model.data()), cost_model.size()}, false);
      const std::string latest = std::to_string(at.steps_done) + "\n";
      write_atomically(c.checkpoint + "/LATEST",
                       {reinterpret_cast<const std::uint8_t*>(latest.data()), latest.size()},
                       false);
    }
    ctx->barrier();
    // Older sets are no longer needed.
    for (const auto& entry : std::filesystem::directory_iterator(c.checkpoint)) {
      const std::string name = entry.path().filename().string();
      const std::string mine = ".rank-" + std::to_string(rank) + ".ckpt";
      if (name.rfind("step-", 0) == 0 && name.size() > mine.size() &&
          name.compare(name.size() - mine.size(), mine.size(), mine) == 0 &&
          entry.path().string() != rank_file(c.checkpoint, at.steps_done, rank)) {
        std::filesystem::remove(entry.path());
      }
    }
  };

  Position start;
  if (c.resume) {
    const auto latest_bytes = read_file(c.checkpoint + "/LATEST");
    const long latest = std::stol(std::string(latest_bytes.begin(), latest_bytes.end()));
    const std::string path = rank_file(c.checkpoint, latest, rank);
    const std::vector<std::uint8_t> bytes = read_file(path);
    Reader in{bytes, path};
    char magic[4];
    in.take(magic, 4);
    if (std::memcmp(magic, "GSTC", 4) != 0) throw std::runtime_error(path + ": not a checkpoint");
    std::uint64_t header[6];
    in.take(header, sizeof header);
    if (header[0] != 1 || header[1] != static_cast<std::uint64_t>(world) || header[2] != total) {
      throw std::runtime_error(path + ": written by " + std::to_string(header[1]) + " ranks for " +
                               std::to_string(header[2]) + " parameters; this run has " +
                               std::to_string(world) + " and " + std::to_string(total));
    }
    start.steps_done = static_cast<long>(header[3]);
    start.epoch = static_cast<int>(header[4]);
    start.step = header[5];
    const auto values = in.blob();
    if (values.size() != total * sizeof(float)) throw std::runtime_error(path + ": model size");
    std::memcpy(model->values().data(), values.data(), values.size());
    const auto optimizer_state = in.blob();
    if (zero) {
      zero->load_state(optimizer_state);
    } else {
      optimizer->load_state(optimizer_state);
    }
    const auto reducer_state = in.blob();
    if (reducer) reducer->load_state(reducer_state);
    if (talk) {
      std::fprintf(stderr, "gradsync-train: resumed from %s at step %ld (epoch %d, step %zu)\n",
                   path.c_str(), start.steps_done, start.epoch + 1, start.step);
    }
  }
  int saves = 0;
  if (talk) {
    std::fprintf(stderr,
                 "gradsync-train: %s; %d ranks x batch %zu x %d micro-batches; %zu steps per "
                 "epoch; codec %s; zero %d; %s lr %g%s; %s\n",
                 model->describe().c_str(), world, c.batch, c.accumulate, steps_per_epoch,
                 reducer ? reducer->codec_spec().c_str() : "none", c.zero, c.optimizer.c_str(),
                 c.lr, c.cosine ? " cosine" : "", c.overlap ? "overlap" : "no overlap");
  }

  const std::size_t pixels = train_set.rows * train_set.cols;
  std::vector<float> images(c.batch * pixels);
  std::vector<std::uint8_t> labels(c.batch);
  Totals t;
  double accuracy = 0;
  const auto started = Clock::now();
  long steps_done = start.steps_done;
  int epochs_done = start.epoch;
  // Rank 0's loss, training-batch accuracy and wall time at every step, for the JSON.
  std::vector<float> losses, accuracies;
  std::vector<double> walls, test_accuracies;
  for (int epoch = start.epoch; epoch < c.epochs && (c.max_steps < 0 || steps_done < c.max_steps);
       ++epoch) {
    const auto epoch_start = Clock::now();
    std::size_t epoch_samples = 0;
    for (std::size_t step = epoch == start.epoch ? start.step : 0; step < steps_per_epoch; ++step) {
      if (c.max_steps >= 0 && steps_done >= c.max_steps) break;
      const auto step_start = Clock::now();
      float loss = 0;
      std::size_t correct = 0;
      gradsync::StepStats stats;
      // Once per optimizer step: the residuals change only when the step communicates.
      const bool ahead = step_ahead && look_ahead(*reducer, *model, lr_at(steps_done), saved);
      for (int micro = 0; micro < c.accumulate; ++micro) {
        const auto batch = sampler.batch(
            static_cast<std::size_t>(epoch),
            step * static_cast<std::size_t>(c.accumulate) + static_cast<std::size_t>(micro));
        for (std::size_t i = 0; i < batch.size(); ++i) {
          std::memcpy(images.data() + i * pixels, train_set.image(batch[i]).data(),
                      pixels * sizeof(float));
          labels[i] = train_set.labels[batch[i]];
        }
        {
          gradsync::timeline::Span span("forward", "compute");
          model->forward(images, batch.size());
        }
        std::size_t right = 0;
        loss += model->loss(labels, &right) / static_cast<float>(c.accumulate);
        correct += right;
        if (reducer) {
          {
            gradsync::timeline::Span span("backward", "compute");
            model->backward(labels, micro > 0,
                            [&](std::size_t i) { reducer->mark_ready(static_cast<int>(i)); });
          }
          const gradsync::StepStats s = reducer->finish();
          if (s.communicated) stats = s;
        } else {
          gradsync::timeline::Span span("backward", "compute");
          model->backward(labels, micro > 0, [](std::size_t) {});
        }
      }
      if (ahead) look_back(*model, saved);
      std::span<float> grads = model->grads();
      if (c.accumulate > 1) {  // the mean over the K micro-batches
        for (float& g : grads) g /= static_cast<float>(c.accumulate);
      }
      {
        gradsync::timeline::Span span(zero ? "zero step" : "optimizer", "optimizer");
        const auto comm_start = Clock::now();
        if (zero) {
          zero->set_lr(lr_at(steps_done));
          const auto before = ctx->total_traffic().bytes_sent;
          zero->step(model->values(), grads);
          stats.communication_s = stats.exposed_s =
              std::chrono::duration<double>(Clock::now() - comm_start).count();
          stats.bytes_sent = ctx->total_traffic().bytes_sent - before;
          stats.raw_bytes = total * sizeof(float);
          stats.allreduce_calls = 1;
        } else {
          optimizer->set_lr(lr_at(steps_done));
          optimizer->step(model->values(), grads);
        }
      }
      const double step_s = std::chrono::duration<double>(Clock::now() - step_start).count();
      t.step_s += step_s;
      t.compute_s += stats.compute_s;
      t.communication_s += stats.communication_s;
      t.exposed_s += stats.exposed_s;
      t.bytes_sent += stats.bytes_sent;
      t.raw_bytes += stats.raw_bytes;
      t.allreduce_calls += stats.allreduce_calls;
      t.steps += 1;
      const std::size_t samples = c.batch * static_cast<std::size_t>(c.accumulate * world);
      t.samples += samples;
      epoch_samples += samples;
      t.last_loss = loss;
      losses.push_back(loss);
      accuracy = static_cast<double>(correct) /
                 static_cast<double>(c.batch * static_cast<std::size_t>(c.accumulate));
      accuracies.push_back(static_cast<float>(accuracy));
      walls.push_back(std::chrono::duration<double>(Clock::now() - started).count());
      ++steps_done;
      if (!c.checkpoint.empty() && c.checkpoint_every > 0 && steps_done % c.checkpoint_every == 0) {
        const bool epoch_ends = step + 1 == steps_per_epoch;
        save({steps_done, epoch_ends ? epoch + 1 : epoch, epoch_ends ? 0 : step + 1}, ++saves);
      }
      if (talk && (step % 10 == 0 || step + 1 == steps_per_epoch)) {
        const double elapsed = std::chrono::duration<double>(Clock::now() - epoch_start).count();
        progress(c, epoch, step, steps_per_epoch, loss, accuracy,
                 static_cast<double>(epoch_samples) / std::max(elapsed, 1e-9), t);
      }
    }
    ++epochs_done;
    if (!c.checkpoint.empty() && c.checkpoint_every == 0) save({steps_done, epoch + 1, 0}, ++saves);
    const double test_accuracy = evaluate(*ctx, *model, test_set, 256);
    if (talk) std::fprintf(stderr, "  test accuracy %.2f%%\n", 100 * test_accuracy);
    test_accuracies.push_back(test_accuracy);
    accuracy = test_accuracy;
  }
  const double wall = std::chrono::duration<double>(Clock::now() - started).count();
  if (const std::size_t events = gradsync::timeline::write(*ctx); events && rank == 0) {
    std::fprintf(stderr, "gradsync-train: timeline of %zu events written\n", events);
  }
  const double test_accuracy = accuracy;
  const double comm_fraction = t.step_s > 0 ? t.communication_s / t.step_s : 0;
  const double overlap_fraction =
      t.communication_s > 0 ? std::max(0.0, 1.0 - t.exposed_s / t.communication_s) : 0;
  // Where every peer is reached through shared memory, most bytes move through the arena,
  // which the transport counters do not see.
  bool shared_memory_only = world > 1;
  for (int peer = 0; peer < world; ++peer) {
    if (peer != rank && ctx->transport_name(peer) != "shm") shared_memory_only = false;
  }
  if (rank == 0) {
    std::printf(
        "gradsync-train: %d epochs, %zu steps in %.1f s: %.0f samples/s, final loss %.4f, test "
        "accuracy %.2f%%; communication %.0f%% of the step time, %.0f%% of it overlapped; "
        "%.1f MB sent per rank%s (%.3f of the float32 gradients), %zu all-reduce calls\n",
        epochs_done, t.steps, wall, static_cast<double>(t.samples) / wall, t.last_loss,
        100 * test_accuracy, 100 * comm_fraction, 100 * overlap_fraction,
        static_cast<double>(t.bytes_sent) / 1e6,
        shared_memory_only ? " through the transports (shared-memory arenas not counted)" : "",
        t.raw_bytes ? static_cast<double>(t.bytes_sent) / static_cast<double>(t.raw_bytes) : 0.0,
        t.allreduce_calls);
  }
  if (rank == 0 && !c.json.empty()) {
    std::ofstream f(c.json);
    if (!f) {
      std::fprintf(stderr, "gradsync-train: cannot write %s\n", c.json.c_str());
      return 1;
    }
    f << "{\n  \"test_accuracy\": " << test_accuracy << ",\n  \"final_loss\": " << t.last_loss
      << ",\n  \"epochs\": " << epochs_done << ",\n  \"steps\": " << t.steps
      << ",\n  \"wall_s\": " << wall
      << ",\n  \"samples_per_s\": " << static_cast<double>(t.samples) / wall
      << ",\n  \"step_s\": " << (t.steps ? t.step_s / static_cast<double>(t.steps) : 0)
      << ",\n  \"communication_s_per_step\": "
      << (t.steps ? t.communication_s / static_cast<double>(t.steps) : 0)
      << ",\n  \"exposed_s_per_step\": "
      << (t.steps ? t.exposed_s / static_cast<double>(t.steps) : 0)
      << ",\n  \"comm_fraction\": " << comm_fraction
      << ",\n  \"overlap_fraction\": " << overlap_fraction
      << ",\n  \"bytes_sent_per_rank\": " << t.bytes_sent << ",\n  \"compression_ratio\": "
      << (t.raw_bytes ? static_cast<double>(t.bytes_sent) / static_cast<double>(t.raw_bytes) : 0)
      << ",\n  \"allreduce_calls\": " << t.allreduce_calls
      << ",\n  \"optimizer_state_bytes_per_rank\": "
      << (zero ? zero->memory().optimizer_state_bytes : optimizer->state_bytes())
      << ",\n  \"reduced_gradient_bytes_per_rank\": "
      << (zero ? zero->memory().reduced_gradient_bytes : total * sizeof(float))
      << ",\n  \"losses\": [";
    char buf[32];
    for (std::size_t i = 0; i < losses.size(); ++i) {
      std::snprintf(buf, sizeof buf, "%s%.9g", i ? ", " : "", static_cast<double>(losses[i]));
      f << buf;
    }
    f << "],\n  \"train_accuracy\": [";
    for (std::size_t i = 0; i < accuracies.size(); ++i) {
      std::snprintf(buf, sizeof buf, "%s%.4f", i ? ", " : "", static_cast<double>(accuracies[i]));
      f << buf;
    }
    f << "],\n  \"wall_at_step\": [";
    for (std::size_t i = 0; i < walls.size(); ++i) {
      std::snprintf(buf, sizeof buf, "%s%.3f", i ? ", " : "", walls[i]);
      f << buf;
    }
    f << "],\n  \"test_accuracy_per_epoch\": [";
    for (std::size_t i = 0; i < test_accuracies.size(); ++i) {
      std::snprintf(buf, sizeof buf, "%s%.4f", i ? ", " : "", test_accuracies[i]);
      f << buf;
    }
    f << "],\n  \"config\": {\"model\": \"" << json_escape(model->describe())
      << "\", \"ranks\": " << world << ", \"batch\": " << c.batch << ", \"lr\": " << c.lr
      << ", \"lr_schedule\": \"" << (c.cosine ? "cosine" : "constant") << "\", \"optimizer\": \""
      << c.optimizer << "\", \"seed\": " << c.seed << ", \"codec\": \""
      << json_escape(reducer ? reducer->codec_spec() : c.codec)
      << "\", \"bucket_mb\": " << c.bucket_mb << ", \"first_bucket_mb\": " << c.first_bucket_mb
      << ", \"overlap\": " << (c.overlap ? "true" : "false")
      << ", \"step_ahead\": " << (step_ahead ? "true" : "false")
      << ", \"accumulate\": " << c.accumulate << ", \"zero\": " << c.zero
      << ", \"epochs\": " << c.epochs << ", \"max_steps\": " << c.max_steps << "}\n}\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Config c = parse(argc, argv);
  try {
    return run(c);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gradsync-train: %s\n", e.what());
    return 1;
  }
}
