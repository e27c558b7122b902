// gradsync-train's flags: reading them one at a time, then the checks between them. Every
// refusal exits 2 with the usage after the reason, before any rank starts.
#include "train/flags.h"

#include <gradsync/compress.h>
#include <gradsync/version.h>

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <sstream>

#include "flag_numbers.h"

namespace train {
namespace {

constexpr const char* kUsage =
    "usage: gradsync-train [options]   (one process per rank: run it under gradsync-run)\n"
    "       gradsync-train --version\n"
    "  --model mlp|cnn        the network (default mlp: 784-2048x4-10, 14.2 M parameters)\n"
    "  --hidden A,B,...       the MLP's hidden widths (default 2048,2048,2048,2048)\n"
    "  --epochs N             passes over the training set (default 1)\n"
    "  --batch B              samples per rank per micro-batch (default 64)\n"
    "  --lr X                 learning rate (default 0.05 sgd, 0.001 adamw, 0.01 lamb, 1 lars)\n"
    "  --lr-schedule S        constant (default); cosine: lr (1 + cos(pi t / T)) / 2 at step\n"
    "                         t of T, as torch's CosineAnnealingLR to zero; or poly: lr (1 -\n"
    "                         t / T)^P, the LAMB paper's polynomial decay (t and T after any\n"
    "                         warm-up)\n"
    "  --poly-power P         poly's exponent P (default 1)\n"
    "  --lr-scaling S         none (default), linear or sqrt: --lr times (or times the square\n"
    "                         root of) the global batch (batch x ranks x accumulate) over\n"
    "  --base-batch B         (default 256), for large batches\n"
    "  --warmup-epochs E      the rate rises linearly from 0 over the first E epochs (default 0)\n"
    "  --optimizer O          sgd (default; momentum 0.9, none when the codec has momentum=M),\n"
    "                         adamw, lars (SGD with momentum and a trust ratio per tensor) or\n"
    "                         lamb (AdamW with a trust ratio per tensor); lars and lamb need\n"
    "                         --zero 0\n"
    "  --weight-decay X       sgd's (added to the gradient, as torch's), adamw's and lamb's\n"
    "                         (decoupled) or lars's (default 0 sgd and lars, 0.01 adamw and\n"
    "                         lamb)\n"
    "  --exclude-biases       lars and lamb step biases (1-D tensors) without weight decay or\n"
    "                         trust ratio, as NVIDIA's LAMB\n"
    "  --beta2 X              adamw's and lamb's second-moment decay, in (0, 1) (default 0.999)\n"
    "  --seed S               weights and data order (default 1)\n"
    "  --codec SPEC           gradient codec (default none; fp16, int8, topk:ratio=0.01, ...)\n"
    "  --amp bf16|fp16        mixed precision: forward and backward rounded to it, float32\n"
    "                         master weights, gradients sent in it; fp16 scales the loss as\n"
    "                         torch's GradScaler (a step with Inf or NaN anywhere is skipped)\n"
    "  --bucket-mb X          bucket size (default 25)\n"
    "  --first-bucket-mb X    first bucket size (default 1)\n"
    "  --no-overlap           all-reduce only after backward, for comparison\n"
    "  --step-ahead 0|1       with a codec that holds gradient back (error feedback) and SGD,\n"
    "                         compute gradients at value - lr * held back (default 1)\n"
    "  --accumulate K         K micro-batches per optimizer step, communicating once\n"
    "  --zero 0|1|2|3         ZeRO stage (1: sharded optimizer state, each layer's gradient\n"
    "                         reduce-scattered as backward has it, once a step, and the\n"
    "                         parameters gathered after the step; 2: sharded gradients too,\n"
    "                         reduce-scattered every micro-batch; 3: sharded parameters too,\n"
    "                         each layer gathered as it runs); 1-3 take --codec none, fp16 or\n"
    "                         bf16 (parameters and gradients) or int8 (gradients, with error\n"
    "                         feedback)\n"
    "  --strategy S           ddp (--zero 0), zero1, zero2 or zero3 (--zero 1, 2, 3)\n"
    "  --prefetch N           ZeRO 3: the layers whose gathers are queued ahead of their use\n"
    "                         (default 1; 0 with --no-overlap)\n"
    "  --max-steps N          stop after N optimizer steps (benchmarks; default: all)\n"
    "  --data DIR             Fashion-MNIST IDX files (default /usr/share/datasets/fashion-mnist)\n"
    "  --json FILE            rank 0 writes the run's metrics and configuration to FILE\n"
    "  --checkpoint DIR       save model, optimizer, codec and data position to DIR (each\n"
    "                         rank its file, written atomically; DIR/LATEST names the step)\n"
    "  --checkpoint-every N   every N steps (default: at the end of each epoch)\n"
    "  --resume               continue from DIR/LATEST (same ranks and flags), with the\n"
    "                         cost model the checkpoint's run chose algorithms by\n"
    "  --overwrite            a new run replaces the checkpoints DIR holds (without it or\n"
    "                         --resume, a DIR that holds checkpoints is refused)\n"
    "  --quiet                no progress bar\n"
    "Started again by gradsync-run --max-restarts (GRADSYNC_RESTART_COUNT > 0), a run with\n"
    "--checkpoint DIR resumes from DIR/LATEST, or starts over if it failed before its first.\n";

[[noreturn]] void usage_error(const std::string& what) {
  std::fprintf(stderr, "gradsync-train: %s\n%s", what.c_str(), kUsage);
  std::exit(2);
}

// The ranges of the numeric flags: wide enough for any run this trainer can make, narrow
// enough that what they size (a batch, a layer, a bucket) is never a bad_alloc waiting to
// happen, nor a count an int cannot hold.
constexpr long kMaxEpochs = 1000000;
constexpr long kMaxBatch = 65536;  // the whole training set is 60,000 samples
constexpr long kMaxWidth = 16384;  // a 16384 x 16384 layer is already 1 GiB of weights
constexpr std::size_t kMaxHiddenLayers = 64;
constexpr long kMaxAccumulate = 65536;
constexpr long kMaxPrefetch = 1024;  // past the layers of any model here: all gathered ahead
constexpr long kMaxSteps = 1000000000;
constexpr double kMaxLearningRate = 1000;
constexpr double kMaxBucketMb = 4096;
constexpr double kMaxWeightDecay = 1;  // a decay of lr x 1 per step already zeroes weights
constexpr double kMaxPolyPower = 16;

// A positive finite number in (0, high].
double number(const std::string& flag, const std::string& v, double high) {
  return gradsync::flags::number(flag, v, 0, high, true, usage_error);
}

// A whole number in [low, high], read as one (not through a double, which rounds past 2^53).
long whole(const std::string& flag, const std::string& v, long low, long high = kMaxSteps) {
  return static_cast<long>(gradsync::flags::integer(flag, v, low, high, usage_error));
}

// The command line, read left to right: a flag, then the value it takes, if any.
class Arguments {
 public:
  Arguments(int argc, char** argv) : argc_(argc), argv_(argv) {}
  bool done() const { return at_ + 1 >= argc_; }
  std::string next_flag() { return argv_[++at_]; }
  std::string value_of(const std::string& flag) {
    if (at_ + 1 >= argc_) usage_error(flag + " needs a value");
    return argv_[++at_];
  }

 private:
  int argc_;
  char** argv_;
  int at_ = 0;  // argv_[at_] was read last
};

std::vector<std::size_t> hidden_widths(const std::string& list) {
  std::vector<std::size_t> widths;
  std::stringstream in(list);
  for (std::string w; std::getline(in, w, ',');) {
    widths.push_back(static_cast<std::size_t>(whole("--hidden", w, 1, kMaxWidth)));
  }
  if (widths.empty()) usage_error("--hidden: '" + list + "' names no width");
  return widths;
}

// The network, the data order and the optimizer; false when `flag` is none of them.
bool read_model_flag(const std::string& flag, Arguments& args, Config& c) {
  if (flag == "--model") {
    c.model = args.value_of(flag);
    if (c.model != "mlp" && c.model != "cnn") usage_error("--model is mlp or cnn");
  } else if (flag == "--hidden") {
    const std::vector<std::size_t> widths = hidden_widths(args.value_of(flag));
    c.hidden.insert(c.hidden.end(), widths.begin(), widths.end());
    if (c.hidden.size() > kMaxHiddenLayers) {
      usage_error("--hidden: " + std::to_string(c.hidden.size()) + " layers, more than " +
                  std::to_string(kMaxHiddenLayers));
    }
  } else if (flag == "--epochs") {
    c.epochs = static_cast<int>(whole(flag, args.value_of(flag), 1, kMaxEpochs));
  } else if (flag == "--batch") {
    c.batch = static_cast<std::size_t>(whole(flag, args.value_of(flag), 1, kMaxBatch));
  } else if (flag == "--lr") {
    c.lr = number(flag, args.value_of(flag), kMaxLearningRate);
  } else if (flag == "--lr-schedule") {
    c.lr_schedule = args.value_of(flag);
    if (c.lr_schedule != "constant" && c.lr_schedule != "cosine" && c.lr_schedule != "poly") {
      usage_error("--lr-schedule is constant, cosine or poly");
    }
  } else if (flag == "--poly-power") {
    c.poly_power = number(flag, args.value_of(flag), kMaxPolyPower);
  } else if (flag == "--lr-scaling") {
    c.lr_scaling = args.value_of(flag);
    if (c.lr_scaling != "none" && c.lr_scaling != "linear" && c.lr_scaling != "sqrt") {
      usage_error("--lr-scaling is none, linear or sqrt");
    }
  } else if (flag == "--base-batch") {
    c.base_batch = static_cast<std::size_t>(whole(flag, args.value_of(flag), 1, kMaxBatch));
  } else if (flag == "--warmup-epochs") {
    c.warmup_epochs =
        gradsync::flags::number(flag, args.value_of(flag), 0, kMaxEpochs, false, usage_error);
  } else if (flag == "--optimizer") {
    c.optimizer = args.value_of(flag);
    if (c.optimizer != "sgd" && c.optimizer != "adamw" && c.optimizer != "lars" &&
        c.optimizer != "lamb") {
      usage_error("--optimizer is sgd, adamw, lars or lamb");
    }
  } else if (flag == "--weight-decay") {
    c.weight_decay =
        gradsync::flags::number(flag, args.value_of(flag), 0, kMaxWeightDecay, false, usage_error);
  } else if (flag == "--exclude-biases") {
    c.exclude_biases = true;
  } else if (flag == "--beta2") {
    const std::string v = args.value_of(flag);
    c.beta2 = number(flag, v, 1);
    // 1 would divide by Adam's bias correction 1 - beta2^t = 0; 0 is refused as (0, 1] says.
    if (c.beta2 >= 1) usage_error(gradsync::flags::refusal(flag, v, "a number", "(0, 1)"));
  } else if (flag == "--seed") {
    c.seed = static_cast<std::uint64_t>(
        whole(flag, args.value_of(flag), 0, std::numeric_limits<long>::max()));
  } else {
    return false;
  }
  return true;
}

// How the gradients travel: codec, buckets, overlap, accumulation, ZeRO; false when `flag` is
// none of them.
bool read_communication_flag(const std::string& flag, Arguments& args, Config& c) {
  if (flag == "--codec") {
    c.codec = args.value_of(flag);
  } else if (flag == "--amp") {
    c.amp = args.value_of(flag);
    if (c.amp != "none" && c.amp != "bf16" && c.amp != "fp16") {
      usage_error("--amp is none, bf16 or fp16");
    }
  } else if (flag == "--bucket-mb") {
    c.bucket_mb = number(flag, args.value_of(flag), kMaxBucketMb);
  } else if (flag == "--first-bucket-mb") {
    c.first_bucket_mb = number(flag, args.value_of(flag), kMaxBucketMb);
  } else if (flag == "--no-overlap") {
    c.overlap = false;
  } else if (flag == "--step-ahead") {
    const std::string v = args.value_of(flag);
    if (v != "0" && v != "1") usage_error("--step-ahead is 0 or 1");
    c.step_ahead = v == "1";
  } else if (flag == "--accumulate") {
    c.accumulate = static_cast<int>(whole(flag, args.value_of(flag), 1, kMaxAccumulate));
  } else if (flag == "--zero") {
    c.zero = static_cast<int>(whole(flag, args.value_of(flag), 0, 3));
  } else if (flag == "--prefetch") {
    c.prefetch = static_cast<int>(whole(flag, args.value_of(flag), 0, kMaxPrefetch));
  } else if (flag == "--strategy") {
    const std::string v = args.value_of(flag);
    if (v != "ddp" && v != "zero1" && v != "zero2" && v != "zero3")
      usage_error("--strategy is ddp, zero1, zero2 or zero3");
    c.zero = v == "ddp" ? 0 : v[4] - '0';
  } else {
    return false;
  }
  return true;
}

// How long the run lasts, what it reads and writes; false when `flag` is none of these.
bool read_run_flag(const std::string& flag, Arguments& args, Config& c) {
  if (flag == "--max-steps") {
    c.max_steps = whole(flag, args.value_of(flag), 1);
  } else if (flag == "--data") {
    c.data = args.value_of(flag);
  } else if (flag == "--json") {
    c.json = args.value_of(flag);
  } else if (flag == "--quiet") {
    c.quiet = true;
  } else if (flag == "--checkpoint") {
    c.checkpoint = args.value_of(flag);
  } else if (flag == "--checkpoint-every") {
    c.checkpoint_every = whole(flag, args.value_of(flag), 1);
  } else if (flag == "--resume") {
    c.resume = true;
  } else if (flag == "--overwrite") {
    c.overwrite = true;
  } else {
    return false;
  }
  return true;
}

// The defaults that depend on other flags, and the pairs of flags that cannot go together.
void complete_and_check(Config& c) {
  // --lr itself is refused unless positive, so below 0 can only be the default's marker.
  if (c.lr < 0)
    c.lr = c.optimizer == "adamw"  ? 0.001
           : c.optimizer == "lamb" ? 0.01
           : c.optimizer == "lars" ? 1.0
                                   : 0.05;
  const bool adam = c.optimizer == "adamw" || c.optimizer == "lamb";
  if (c.weight_decay < 0) c.weight_decay = default_weight_decay(c.optimizer);
  if (c.beta2 >= 0 && !adam)
    usage_error("--beta2 is Adam's: give it with --optimizer adamw or lamb");
  if (c.beta2 < 0) c.beta2 = 0.999;
  if (c.exclude_biases && c.optimizer != "lars" && c.optimizer != "lamb") {
    usage_error("--exclude-biases is for the trust ratios of --optimizer lars and lamb");
  }
  if (c.poly_power > 0 && c.lr_schedule != "poly") {
    usage_error("--poly-power is poly's: give it with --lr-schedule poly");
  }
  if (c.lr_schedule == "poly" && c.poly_power == 0) c.poly_power = 1;
  if ((c.optimizer == "lars" || c.optimizer == "lamb") && c.zero > 0) {
    usage_error("--optimizer " + c.optimizer +
                " scales each tensor by its norms; ZeRO's shards cut tensors: use --zero 0");
  }
  if ((c.resume || c.checkpoint_every) && c.checkpoint.empty()) {
    usage_error("--resume and --checkpoint-every need --checkpoint DIR");
  }
  if (c.overwrite && (c.checkpoint.empty() || c.resume)) {
    usage_error(
        "--overwrite replaces the checkpoints of --checkpoint DIR: give it without --resume");
  }
  if (c.optimizer != "sgd" && codec_has_momentum(c.codec)) {
    usage_error("a codec with momentum= takes the place of SGD's momentum: use --optimizer sgd");
  }
  if (c.amp != "none") {
    if (c.codec != "none" && c.codec != c.amp) {
      usage_error("--amp " + c.amp + " sends " + c.amp + " gradients: leave out --codec " +
                  c.codec);
    }
    c.codec = c.amp;
  }
  if (c.zero >= 1 && c.codec != "none" && c.codec != "fp16" && c.codec != "bf16" &&
      c.codec != "int8") {
    usage_error("--zero " + std::to_string(c.zero) +
                " reduce-scatters each layer's gradient and gathers its parameters in float32 "
                "or 16 bits (--codec fp16, bf16), or the gradients in int8 (--codec int8); "
                "--codec " +
                c.codec +
                " compresses whole tensors, which a shard is not: use --zero 0, which "
                "all-reduces through the codec");
  }
}

}  // namespace

double default_weight_decay(const std::string& optimizer) {
  return optimizer == "adamw" || optimizer == "lamb" ? 0.01 : 0.0;
}

bool codec_has_momentum(const std::string& spec) {
  return gradsync::compress::CodecSpec::parse(spec).get("momentum", 0) > 0;
}

Config parse_flags(int argc, char** argv) {
  Config c;
  for (Arguments args(argc, argv); !args.done();) {
    const std::string flag = args.next_flag();
    if (flag == "-h" || flag == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (flag == "--version") {
      std::printf("gradsync-train %s\n", gradsync::version());
      std::exit(0);
    }
    if (!read_model_flag(flag, args, c) && !read_communication_flag(flag, args, c) &&
        !read_run_flag(flag, args, c)) {
      usage_error("unknown option '" + flag + "'");
    }
  }
  complete_and_check(c);
  return c;
}

}  // namespace train
