// gradsync-bench: sweeps message sizes for one collective and reports time, algorithm and bus
// bandwidth in the nccl-tests convention, plus the bytes each rank really sent; or, as
// `pingpong`, the one-way time of a send/recv round trip between ranks 0 and 1 (the OSU
// latency benchmark's measure).
// Run it under gradsync-run:  gradsync-run -n 4 -- gradsync-bench allreduce --check

#include <gradsync/compress.h>
#include <gradsync/gradsync.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <set>
#include <string>
#include <vector>

#include "flag_numbers.h"
#include "json_writer.h"
#include "placed_buffer.h"

namespace {

using Clock = std::chrono::steady_clock;

enum class Collective { kAllreduce, kReduceScatter, kAllgather, kBroadcast, kPingPong };

constexpr const char* kUsage =
    "usage: gradsync-bench <allreduce|reduce_scatter|allgather|broadcast|pingpong> [options]\n"
    "       gradsync-bench --version\n"
    "Run every rank under gradsync-run (or any launcher that sets RANK/WORLD_SIZE/...).\n"
    "\n"
    "  --min-bytes B     smallest message (default 4096; K/M/G suffixes are powers of 1024)\n"
    "  --max-bytes B     largest message (default 64M)\n"
    "  --factor F        size multiplier between steps, integer >= 2 (default 2)\n"
    "  --dtype T         float32 float64 float16 bfloat16 int8 int16 int32 int64 uint8 bool\n"
    "                    (default float32)\n"
    "  --op OP           sum avg min max prod, or the bitwise band bor bxor (integer and bool\n"
    "                    dtypes only) (default sum; ignored by allgather/broadcast)\n"
    "  --algo A          auto ring rd hd ps shm hier, per allreduce call (default auto)\n"
    "  --codec SPEC      allreduce float32 (sum/avg) through a gradient codec: none, fp16,\n"
    "                    bf16, int8[:block=B], qsgd[:levels=S], topk:ratio=R, randomk:ratio=R,\n"
    "                    threshold:rel=R, sign, powersgd:rank=R (the tensor is a matrix of\n"
    "                    about sqrt(count) rows), each [,ef=0|1]; each call starts from the\n"
    "                    input, copied before the call and a barrier, untimed.\n"
    "                    wire(x) = sent/rank over a float32 ring's 2(n-1)/n x size\n"
    "  --transport T     shm | tcp | ucx | shm+ucx | \"\" for automatic (Options.transport)\n"
    "  --root R          broadcast root (default 0)\n"
    "  --iters N         timed calls per size (default 20)\n"
    "  --warmup N        untimed calls per size first (default 5)\n"
    "  --check           verify each size's result exactly; counts wrong elements\n"
    "  --per-call        time each call alone after an untimed barrier (what --codec does),\n"
    "                    to compare plain calls with codec calls like for like\n"
    "  --non-finite P    --codec calls: throw (default), skip or propagate on NaN/Inf\n"
    "  --json FILE       rank 0 writes one record per size to FILE\n"
    "  --offset B        send and receive buffers start B bytes (0-4095) past a page\n"
    "                    boundary (default 0: where malloc puts them changes some copies'\n"
    "                    speed, so every run starts them on a page)\n"
    "  --async           pingpong: send_async/recv_async and wait (the worker's path), not\n"
    "                    the blocking send/recv\n"
    "\n"
    "size(B) is the whole buffer: for reduce_scatter the input, for allgather the output\n"
    "(ranks x block), as in nccl-tests; counts are rounded down to a multiple of the ranks.\n"
    "time(us) is the mean time per call of a loop of --iters calls, max over ranks.\n"
    "busbw = algbw x 2(n-1)/n for allreduce, (n-1)/n for reduce_scatter/allgather, 1 for\n"
    "broadcast; GB/s = 1e9 bytes/s. sent/rank(B) is bytes handed to the transports per\n"
    "call, max over ranks. --check inputs are small integers ((rank+1)*(i%7+1))%16 (1 or 2\n"
    "for prod) so results are exact: sums stay exact up to 17 ranks even in bfloat16.\n"
    "pingpong: rank 0 sends size bytes to rank 1, which sends them back (other ranks wait);\n"
    "time(us) is half the round trip, algbw = busbw = size over it; --check compares what\n"
    "each of the two received with what rank 0 sent; dtype uint8.\n";

struct Config {
  Collective coll = Collective::kAllreduce;
  std::string coll_name;
  std::size_t min_bytes = 4096;
  std::size_t max_bytes = std::size_t{64} << 20;
  std::size_t factor = 2;
  gradsync::DataType dtype = gradsync::DataType::kFloat32;
  gradsync::ReduceOp op = gradsync::ReduceOp::kSum;
  gradsync::Algorithm algo = gradsync::Algorithm::kAuto;
  std::string transport;
  bool transport_set = false;
  int root = 0;
  int iters = 20;
  int warmup = 5;
  bool check = false;
  bool per_call = false;  // time each call alone, after a barrier (as --codec always does)
  bool async = false;     // pingpong through the _async calls
  gradsync::compress::NonFinite non_finite = gradsync::compress::NonFinite::kThrow;
  std::string json;
  std::string codec;       // empty: plain allreduce
  std::size_t offset = 0;  // of both buffers past a page boundary
};

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "gradsync-bench: %s\n%s", msg.c_str(), kUsage);
  std::exit(2);
}

// The largest message: a rank holds a send and a receive buffer of up to this size, which
// must fit in this machine's memory (a size past it ended in std::bad_alloc mid-run).
std::size_t max_message_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return std::size_t{1} << 30;
  return static_cast<std::size_t>(pages) / 2 * static_cast<std::size_t>(page);
}

std::size_t parse_bytes(const std::string& flag, const std::string& v) {
  return static_cast<std::size_t>(
      gradsync::flags::bytes(flag, v, 0, max_message_bytes(), usage_error));
}

// Calls per size: a million already takes longer than anyone waits for a sweep.
constexpr long long kMaxCalls = 1000000;
// Ranks gradsync accepts (RANK and WORLD_SIZE in README's launcher table).
constexpr long long kMaxRoot = (1 << 20) - 1;
using Buffer = gradsync::tools::PlacedBuffer<std::uint8_t>;

int parse_count(const std::string& flag, const std::string& v, long long lo, long long hi) {
  return static_cast<int>(gradsync::flags::integer(flag, v, lo, hi, usage_error));
}

Config parse_args(int argc, char** argv) {
  Config c;
  if (argc < 2) usage_error("no collective given");
  c.coll_name = argv[1];
  if (c.coll_name == "-h" || c.coll_name == "--help") {
    std::fputs(kUsage, stdout);
    std::exit(0);
  }
  if (c.coll_name == "--version") {
    std::printf("gradsync-bench %s\n", gradsync::version());
    std::exit(0);
  }
  if (c.coll_name == "allreduce")
    c.coll = Collective::kAllreduce;
  else if (c.coll_name == "reduce_scatter")
    c.coll = Collective::kReduceScatter;
  else if (c.coll_name == "allgather")
    c.coll = Collective::kAllgather;
  else if (c.coll_name == "broadcast")
    c.coll = Collective::kBroadcast;
  else if (c.coll_name == "pingpong") {
    c.coll = Collective::kPingPong;
    c.dtype = gradsync::DataType::kUInt8;  // any size is whole elements
  } else
    usage_error("unknown collective '" + c.coll_name + "'");
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--min-bytes")
      c.min_bytes = parse_bytes(a, value());
    else if (a == "--max-bytes")
      c.max_bytes = parse_bytes(a, value());
    else if (a == "--factor")
      c.factor = static_cast<std::size_t>(parse_count(a, value(), 2, 1 << 20));
    else if (a == "--dtype") {
      auto d = gradsync::parse_dtype(value());
      if (!d) usage_error("unknown --dtype '" + std::string(argv[i]) + "'");
      c.dtype = *d;
    } else if (a == "--op") {
      auto o = gradsync::parse_op(value());
      if (!o) usage_error("unknown --op '" + std::string(argv[i]) + "'");
      c.op = *o;
    } else if (a == "--algo") {
      auto g = gradsync::parse_algorithm(value());
      if (!g) usage_error("unknown --algo '" + std::string(argv[i]) + "'");
      c.algo = *g;
    } else if (a == "--transport") {
      c.transport = value();
      c.transport_set = true;
    } else if (a == "--root")
      c.root = parse_count(a, value(), 0, kMaxRoot);
    else if (a == "--iters")
      c.iters = parse_count(a, value(), 1, kMaxCalls);
    else if (a == "--warmup")
      c.warmup = parse_count(a, value(), 0, kMaxCalls);
    else if (a == "--check")
      c.check = true;
    else if (a == "--per-call")
      c.per_call = true;
    else if (a == "--async")
      c.async = true;
    else if (a == "--non-finite") {
      const std::string v = value();
      if (v == "throw") {
        c.non_finite = gradsync::compress::NonFinite::kThrow;
      } else if (v == "skip") {
        c.non_finite = gradsync::compress::NonFinite::kSkip;
      } else if (v == "propagate") {
        c.non_finite = gradsync::compress::NonFinite::kPropagate;
      } else {
        usage_error("--non-finite is throw, skip or propagate");
      }
    } else if (a == "--json")
      c.json = value();
    else if (a == "--offset")
      c.offset = static_cast<std::size_t>(
          parse_count(a, value(), 0, static_cast<long long>(Buffer::kPageBytes) - 1));
    else if (a == "--codec") {
      c.codec = value();
      try {
        gradsync::compress::make_codec(c.codec);
      } catch (const gradsync::Error& e) {
        usage_error(e.detail());
      }
    } else if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else
      usage_error("unknown option '" + a + "'");
  }
  if (c.min_bytes > c.max_bytes) usage_error("--min-bytes is larger than --max-bytes");
  if (c.async && c.coll != Collective::kPingPong) usage_error("--async applies to pingpong only");
  if (c.coll == Collective::kPingPong &&
      (c.dtype != gradsync::DataType::kUInt8 || c.op != gradsync::ReduceOp::kSum ||
       !c.codec.empty() || c.root != 0 || c.per_call)) {
    usage_error(
        "pingpong takes sizes, --iters, --warmup, --check, --async, --transport, --json, "
        "--offset");
  }
  if (c.algo != gradsync::Algorithm::kAuto && c.coll != Collective::kAllreduce) {
    usage_error("--algo applies to allreduce only");
  }
  // Refused here rather than by the library on every rank mid-run.
  const bool reduces = c.coll == Collective::kAllreduce || c.coll == Collective::kReduceScatter;
  if (reduces && !gradsync::dtype_op_valid(c.dtype, c.op)) {
    usage_error(std::string("--op ") + gradsync::to_string(c.op) +
                " is bitwise: it takes an integer or bool --dtype, not " +
                gradsync::to_string(c.dtype));
  }
  if (!c.codec.empty() &&
      (c.coll != Collective::kAllreduce || c.dtype != gradsync::DataType::kFloat32 ||
       (c.op != gradsync::ReduceOp::kSum && c.op != gradsync::ReduceOp::kAvg) ||
       c.algo != gradsync::Algorithm::kAuto)) {
    usage_error("--codec takes allreduce of float32 with sum or avg, and no --algo");
  }
  return c;
}

// --- exact inputs and references (the library's kernels are private, so the element
// encodings are redone here) ---

std::uint16_t to_half(float f) {
  std::uint32_t x;
  std::memcpy(&x, &f, 4);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u)
    return static_cast<std::uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0));
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (abs < 0x38800000u) {  // half subnormal or zero: scale into the 10-bit field, round to even
    float scaled = std::fabs(f) * 16777216.0f;  // 2^24: one half subnormal ulp becomes 1
    return static_cast<std::uint16_t>(sign | static_cast<std::uint32_t>(std::nearbyint(scaled)));
  }
  std::uint32_t mant = abs + 0xc8000000u;  // rebias exponent 127 -> 15 (in place)
  mant += 0x0fffu + ((mant >> 13) & 1u);   // round to nearest even on the 13 dropped bits
  return static_cast<std::uint16_t>(sign | (mant >> 13));
}

std::uint16_t to_bfloat16(float f) {
  std::uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>(x >> 16);
}

// Writes `v` (an integer, or an average the library computes in float) as one element.
void store(gradsync::DataType t, std::uint8_t* p, double v) {
  using gradsync::DataType;
  switch (t) {
    case DataType::kFloat32: {
      float f = static_cast<float>(v);
      std::memcpy(p, &f, 4);
      break;
    }
    case DataType::kFloat64:
      std::memcpy(p, &v, 8);
      break;
    case DataType::kFloat16: {
      auto h = to_half(static_cast<float>(v));
      std::memcpy(p, &h, 2);
      break;
    }
    case DataType::kBFloat16: {
      auto h = to_bfloat16(static_cast<float>(v));
      std::memcpy(p, &h, 2);
      break;
    }
    case DataType::kInt32: {
      auto x = static_cast<std::int32_t>(static_cast<std::int64_t>(v));
      std::memcpy(p, &x, 4);
      break;
    }
    case DataType::kInt64: {
      auto x = static_cast<std::int64_t>(v);
      std::memcpy(p, &x, 8);
      break;
    }
    case DataType::kUInt8:
    case DataType::kInt8:
      *p = static_cast<std::uint8_t>(static_cast<std::int64_t>(v) & 0xff);
      break;
    case DataType::kInt16: {
      auto x = static_cast<std::int16_t>(static_cast<std::int64_t>(v));
      std::memcpy(p, &x, 2);
      break;
    }
    case DataType::kBool:
      *p = v != 0 ? 1 : 0;
      break;
  }
}

// Element i of rank r. The pattern repeats every 14 elements (period 7 for the general
// inputs, period 2 for products), so a 14-entry table describes any buffer.
constexpr std::size_t kPeriod = 14;

std::int64_t input_value(gradsync::ReduceOp op, int r, std::size_t i) {
  if (op == gradsync::ReduceOp::kProd) return 1 + static_cast<std::int64_t>((r + i) % 2);
  return ((r + 1) * static_cast<std::int64_t>(i % 7 + 1)) % 16;
}

// A value as `t` holds it: narrow integers wrap, bool is 0 or 1 (the float types hold these
// small integers exactly). On bool a sum, product, min or max of 0s and 1s held this way is
// the library's OR (sum, max) or AND (prod, min).
std::int64_t held(gradsync::DataType t, std::int64_t v) {
  using gradsync::DataType;
  switch (t) {
    case DataType::kUInt8:
      return static_cast<std::uint8_t>(v);
    case DataType::kInt8:
      return static_cast<std::int8_t>(v);
    case DataType::kInt16:
      return static_cast<std::int16_t>(v);
    case DataType::kInt32:
      return static_cast<std::int32_t>(v);
    case DataType::kBool:
      return v != 0 ? 1 : 0;
    default:
      return v;
  }
}

// The reduction of element i over all ranks, with the library's kAvg semantics: float types
// divide the (exact) float sum by n in float (double for float64); integers truncate, their
// sums wrapped first.
double reference_value(gradsync::DataType t, gradsync::ReduceOp op, int n, std::size_t i) {
  using gradsync::ReduceOp;
  std::int64_t acc = held(t, input_value(op, 0, i));
  for (int r = 1; r < n; ++r) {
    std::int64_t v = held(t, input_value(op, r, i));
    switch (op) {
      case ReduceOp::kBand:
        acc &= v;
        break;
      case ReduceOp::kBor:
        acc |= v;
        break;
      case ReduceOp::kBxor:
        acc ^= v;
        break;
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        acc += v;
        break;
      case ReduceOp::kProd:
        acc *= v;
        break;
      case ReduceOp::kMin:
        acc = std::min(acc, v);
        break;
      case ReduceOp::kMax:
        acc = std::max(acc, v);
        break;
    }
  }
  acc = held(t, acc);
  if (op != ReduceOp::kAvg) return static_cast<double>(acc);
  if (t == gradsync::DataType::kFloat64) return static_cast<double>(acc) / n;
  if (gradsync::is_floating(t))
    return static_cast<double>(static_cast<float>(acc) / static_cast<float>(n));
  return static_cast<double>(acc / n);
}

using Table = std::vector<std::uint8_t>;  // kPeriod encoded elements

Table input_table(const Config& c, int rank, gradsync::ReduceOp op) {
  const std::size_t es = gradsync::dtype_size(c.dtype);
  Table t(kPeriod * es);
  for (std::size_t i = 0; i < kPeriod; ++i)
    store(c.dtype, &t[i * es], static_cast<double>(input_value(op, rank, i)));
  return t;
}

Table reference_table(const Config& c, int n) {
  const std::size_t es = gradsync::dtype_size(c.dtype);
  Table t(kPeriod * es);
  for (std::size_t i = 0; i < kPeriod; ++i)
    store(c.dtype, &t[i * es], reference_value(c.dtype, c.op, n, i));
  return t;
}

// Buffer element k holds table entry (first + k) % kPeriod.
void fill(std::uint8_t* buf, std::size_t count, std::size_t first, const Table& t, std::size_t es) {
  for (std::size_t k = 0; k < count; ++k)
    std::memcpy(buf + k * es, &t[((first + k) % kPeriod) * es], es);
}

std::size_t count_wrong(const std::uint8_t* buf, std::size_t count, std::size_t first,
                        const Table& t, std::size_t es) {
  std::size_t wrong = 0;
  for (std::size_t k = 0; k < count; ++k) {
    wrong += std::memcmp(buf + k * es, &t[((first + k) % kPeriod) * es], es) != 0;
  }
  return wrong;
}

// --- one size ---

struct Record {
  std::size_t bytes = 0;  // whole buffer, as in the table
  std::size_t count = 0;  // elements of that buffer
  std::string algo;
  double time_us = 0;
  double algbw_gbps = 0;
  double busbw_gbps = 0;
  std::uint64_t wrong = 0;
  double bytes_sent_per_rank = 0;
  double bytes_across_hosts = 0;  // per call, all ranks together: sent to ranks on other hosts
};

double bus_factor(Collective c, int n) {
  switch (c) {
    case Collective::kAllreduce:
      return 2.0 * (n - 1) / n;
    case Collective::kReduceScatter:
    case Collective::kAllgather:
      return static_cast<double>(n - 1) / n;
    case Collective::kBroadcast:
    case Collective::kPingPong:
      return 1.0;
  }
  return 1.0;
}

class Bench {
 public:
  Bench(const Config& c, gradsync::Context& ctx)
      : c_(c), ctx_(ctx), n_(ctx.size()), rank_(ctx.rank()), es_(gradsync::dtype_size(c.dtype)) {
    // One allocation at the largest size; every step uses a prefix. Inputs are written once:
    // the pattern of an element depends only on its index, never on the size.
    const std::size_t max_count = c.max_bytes / es_;
    std::size_t send_elems = max_count, recv_elems = max_count;
    if (c.coll == Collective::kReduceScatter) recv_elems = max_count / static_cast<std::size_t>(n_);
    if (c.coll == Collective::kAllgather) send_elems = max_count / static_cast<std::size_t>(n_);
    send_.assign(send_elems * es_, c.offset);
    if (c.coll != Collective::kBroadcast) recv_.assign(recv_elems * es_, c.offset);
    const gradsync::ReduceOp in_op =
        (c.coll == Collective::kAllreduce || c.coll == Collective::kReduceScatter)
            ? c.op
            : gradsync::ReduceOp::kSum;
    // Each rank's own pattern; for broadcast the non-roots' differ from the root's, and
    // poison() blanks them before the timed calls anyway.
    fill(send_.data(), send_elems, 0, input_table(c, rank_, in_op), es_);
  }

  // Elements measured for a requested size: whole elements, and for reduce_scatter and
  // allgather a multiple of the ranks so every rank's block is the same.
  std::size_t effective_count(std::size_t bytes) const {
    std::size_t count = bytes / es_;
    if (c_.coll == Collective::kReduceScatter || c_.coll == Collective::kAllgather) {
      count -= count % static_cast<std::size_t>(n_);
    }
    return count;
  }
  std::size_t effective_bytes(std::size_t bytes) const { return effective_count(bytes) * es_; }

  Record run(std::size_t bytes) {
    Record rec;
    const std::size_t count = effective_count(bytes);
    rec.count = count;
    rec.bytes = count * es_;
    const std::size_t block = count / static_cast<std::size_t>(n_);
    rec.algo = algorithm_name(rec.bytes);

    for (int k = 0; k < c_.warmup; ++k) {
      if (codec_) std::memcpy(recv_.data(), send_.data(), count * es_);
      call(count, block);
    }
    if (c_.check) poison(count, block);
    ctx_.barrier();  // outside the timed loop: ranks start it together
    const auto before = ctx_.total_traffic().bytes_sent;
    const auto across_before = sent_across_hosts();
    double seconds = 0;
    if (codec_ || c_.per_call) {
      // Compressed all-reduce works in place: every call starts from the same input, copied
      // outside the timed call (as a trainer's gradients are simply there), and the ranks
      // start each call together. Plain calls copy the same bytes (into the buffer they
      // overwrite), so both start with the cache left alike.
      for (int k = 0; k < c_.iters; ++k) {
        std::memcpy(recv_.data(), send_.data(), count * es_);
        ctx_.barrier();
        const auto t0 = Clock::now();
        call(count, block);
        seconds += std::chrono::duration<double>(Clock::now() - t0).count();
      }
    } else {
      const auto t0 = Clock::now();
      for (int k = 0; k < c_.iters; ++k) call(count, block);
      seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    }
    const auto sent = ctx_.total_traffic().bytes_sent - before;
    double across = static_cast<double>(sent_across_hosts() - across_before) / c_.iters;
    ctx_.allreduce(&across, &across, 1, gradsync::DataType::kFloat64, gradsync::ReduceOp::kSum);
    rec.bytes_across_hosts = across;

    std::uint64_t wrong = c_.check ? check(count, block) : 0;
    // The slowest rank defines the collective's time; per-rank traffic differs for rooted
    // and recursive algorithms, so the busiest rank is the one reported.
    double stats[2] = {seconds / c_.iters, static_cast<double>(sent) / c_.iters};
    ctx_.allreduce(stats, stats, 2, gradsync::DataType::kFloat64, gradsync::ReduceOp::kMax);
    std::int64_t wrong_total = static_cast<std::int64_t>(wrong);
    ctx_.allreduce(&wrong_total, &wrong_total, 1, gradsync::DataType::kInt64,
                   gradsync::ReduceOp::kSum);

    // A ping-pong reports one way: half the round trip.
    const double seconds_per_call = c_.coll == Collective::kPingPong ? stats[0] / 2 : stats[0];
    rec.time_us = seconds_per_call * 1e6;
    rec.bytes_sent_per_rank = stats[1];
    rec.wrong = static_cast<std::uint64_t>(wrong_total);
    rec.algbw_gbps =
        seconds_per_call > 0 ? static_cast<double>(rec.bytes) / seconds_per_call / 1e9 : 0;
    rec.busbw_gbps = rec.algbw_gbps * bus_factor(c_.coll, n_);
    return rec;
  }

  std::uint64_t sent_across_hosts() const {
    std::uint64_t sent = 0;
    for (int p = 0; p < n_; ++p) {
      if (ctx_.host_of(p) != ctx_.host_of(rank_)) sent += ctx_.traffic(p).bytes_sent;
    }
    return sent;
  }

  std::string algorithm_name(std::size_t bytes) const {
    if (c_.coll == Collective::kPingPong) return c_.async ? "async" : "blocking";
    if (c_.coll != Collective::kAllreduce) return "default";
    if (codec_) return codec_->spec();
    auto a =
        c_.algo == gradsync::Algorithm::kAuto ? ctx_.choose_allreduce_algorithm(bytes) : c_.algo;
    return gradsync::to_string(a);
  }

 private:
  // The largest power of two at most sqrt(count) that divides count.
  static std::size_t matrix_rows(std::size_t count) {
    std::size_t rows = 1;
    while ((rows * 2) * (rows * 2) <= count && count % (rows * 2) == 0) rows *= 2;
    return rows;
  }

  void call(std::size_t count, std::size_t block) {
    switch (c_.coll) {
      case Collective::kAllreduce:
        if (codec_) {
          // One tensor per size (codec state is per tensor), a near-square matrix for
          // codecs that compress matrices.
          gradsync::compress::compressed_allreduce(
              ctx_, std::span<float>(reinterpret_cast<float*>(recv_.data()), count), *codec_,
              gradsync::compress::Tensor("bench-" + std::to_string(count), matrix_rows(count)),
              c_.op, c_.non_finite);
        } else {
          ctx_.allreduce(send_.data(), recv_.data(), count, c_.dtype, c_.op,
                         {.algorithm = c_.algo});
        }
        break;
      case Collective::kReduceScatter:
        ctx_.reduce_scatter(send_.data(), recv_.data(), block, c_.dtype, c_.op);
        break;
      case Collective::kAllgather:
        ctx_.allgather(send_.data(), recv_.data(), block, c_.dtype);
        break;
      case Collective::kBroadcast:
        ctx_.broadcast(send_.data(), count, c_.dtype, c_.root);
        break;
      case Collective::kPingPong:
        ping_pong(count);
        break;
    }
  }

  // One round trip: rank 0 sends its input, rank 1 sends back what it received.
  void ping_pong(std::size_t count) {
    const auto dtype = c_.dtype;
    if (rank_ == 0) {
      if (c_.async) {
        gradsync::Work back = ctx_.recv_async(recv_.data(), count, dtype, 1);
        ctx_.send_async(send_.data(), count, dtype, 1).wait();
        back.wait();
      } else {
        ctx_.send(send_.data(), count, dtype, 1);
        ctx_.recv(recv_.data(), count, dtype, 1);
      }
    } else if (rank_ == 1) {
      if (c_.async) {
        ctx_.recv_async(recv_.data(), count, dtype, 0).wait();
        ctx_.send_async(recv_.data(), count, dtype, 0).wait();
      } else {
        ctx_.recv(recv_.data(), count, dtype, 0);
        ctx_.send(recv_.data(), count, dtype, 0);
      }
    }
  }

  // Overwrites the outputs with 0xff bytes (NaN for floats, -1 for integers) so a result the
  // timed calls failed to write cannot pass the check on stale data.
  void poison(std::size_t count, std::size_t block) {
    auto blank = [&](std::uint8_t* p, std::size_t elems) {
      if (elems > 0) std::memset(p, 0xff, elems * es_);
    };
    switch (c_.coll) {
      case Collective::kAllreduce:
        blank(recv_.data(), count);
        break;
      case Collective::kReduceScatter:
        blank(recv_.data(), block);
        break;
      case Collective::kAllgather:
      case Collective::kPingPong:
        blank(recv_.data(), count);
        break;
      case Collective::kBroadcast:
        if (rank_ != c_.root) blank(send_.data(), count);
        break;
    }
  }

  std::uint64_t check(std::size_t count, std::size_t block) {
    switch (c_.coll) {
      case Collective::kAllreduce:
        return count_wrong(recv_.data(), count, 0, reference_table(c_, n_), es_);
      case Collective::kReduceScatter:
        return count_wrong(recv_.data(), block, static_cast<std::size_t>(rank_) * block,
                           reference_table(c_, n_), es_);
      case Collective::kAllgather: {
        std::uint64_t wrong = 0;
        for (int q = 0; q < n_; ++q) {
          wrong += count_wrong(recv_.data() + static_cast<std::size_t>(q) * block * es_, block, 0,
                               input_table(c_, q, gradsync::ReduceOp::kSum), es_);
        }
        return wrong;
      }
      case Collective::kBroadcast: {
        return count_wrong(send_.data(), count, 0,
                           input_table(c_, c_.root, gradsync::ReduceOp::kSum), es_);
      }
      case Collective::kPingPong:
        if (rank_ > 1) return 0;
        return count_wrong(recv_.data(), count, 0, input_table(c_, 0, gradsync::ReduceOp::kSum),
                           es_);
    }
    return 0;
  }

  const Config& c_;
  gradsync::Context& ctx_;
  int n_;
  int rank_;
  std::size_t es_;
  Buffer send_, recv_;
  std::unique_ptr<gradsync::compress::Codec> codec_ =
      c_.codec.empty() ? nullptr : gradsync::compress::make_codec(c_.codec);
};

std::string transports_of(gradsync::Context& ctx) {
  std::set<std::string> names;
  for (int p = 0; p < ctx.size(); ++p) {
    if (p != ctx.rank()) names.insert(ctx.transport_name(p));
  }
  if (names.empty()) return "self";
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : "+") + n;
  return s;
}

// Bytes a rank sent per call over what a float32 ring all-reduce sends, 2(n-1)/n x size: the
// compression ratio of --codec, as the transports counted it.
double wire_ratio(const Record& r, int n) {
  const double ring = 2.0 * (n - 1) / n * static_cast<double>(r.bytes);
  return ring > 0 ? r.bytes_sent_per_rank / ring : 0.0;
}

// One record per size, with the fields run_peers.sh and the bench scripts read (the peer
// benchmarks write the same ones). False, after saying why, if the file could not be written.
bool write_json(const Config& c, const std::vector<Record>& recs, const std::string& transport,
                int n, int hosts) {
  std::ofstream f(c.json);
  if (!f) {
    std::fprintf(stderr, "gradsync-bench: cannot write %s: %s\n", c.json.c_str(),
                 std::strerror(errno));
    return false;
  }
  gradsync::json::Writer w(f);
  w.begin_array();
  for (const Record& r : recs) {
    w.begin_object()
        .field("collective", c.coll_name)
        .field("algo", r.algo)
        .field("transport", transport)
        .field("ranks", n)
        .field("bytes", r.bytes)
        .field("count", r.count)
        .field("dtype", gradsync::to_string(c.dtype))
        .field("time_us", r.time_us)
        .field("algbw_gbps", r.algbw_gbps)
        .field("busbw_gbps", r.busbw_gbps)
        .field("wrong", r.wrong)
        .field("bytes_sent_per_rank", r.bytes_sent_per_rank)
        .field("hosts", hosts)
        .field("bytes_across_hosts", r.bytes_across_hosts)
        .field("wire_ratio", wire_ratio(r, n))
        .end_object();
  }
  w.end_array();
  f.flush();
  if (!f) {
    std::fprintf(stderr, "gradsync-bench: cannot write %s: %s\n", c.json.c_str(),
                 std::strerror(errno));
    return false;
  }
  return true;
}

// Before the sweep, so a long run is not wasted: rank 0, which writes --json, tries the path,
// and every rank learns whether it can (each then exits 2, as for any other refused flag).
void check_json_path(const Config& c, gradsync::Context& ctx) {
  if (c.json.empty()) return;
  std::string why = ctx.rank() == 0 ? gradsync::flags::cannot_write(c.json) : "";
  std::int32_t ok = why.empty() ? 1 : 0;
  ctx.broadcast(&ok, 1, gradsync::DataType::kInt32, 0);
  if (ok) return;
  if (ctx.rank() == 0) {
    std::fprintf(stderr, "gradsync-bench: --json: cannot write %s: %s\n", c.json.c_str(),
                 why.c_str());
  }
  std::exit(2);
}

// "rank R: " where the rank is known and the message does not already name it.
std::string rank_prefix(int rank, const std::exception& e) {
  const auto* error = dynamic_cast<const gradsync::Error*>(&e);
  if (rank < 0 || (error && error->rank() == rank)) return "";
  return "rank " + std::to_string(rank) + ": ";
}

}  // namespace

int main(int argc, char** argv) {
  Config c = parse_args(argc, argv);
  int rank = -1;
  try {
    gradsync::Options opts;
    if (c.transport_set) opts.transport = c.transport;
    auto ctx = gradsync::init(opts);
    rank = ctx->rank();
    const int n = ctx->size();
    if (c.coll == Collective::kPingPong && n < 2) usage_error("pingpong needs 2 ranks or more");
    if (c.coll == Collective::kBroadcast && c.root >= n) {
      usage_error(gradsync::flags::refusal("--root", std::to_string(c.root), "a rank",
                                           "[0, " + std::to_string(n - 1) + "]"));
    }
    check_json_path(c, *ctx);

    // Every rank learns the transports; rank 0's view (its peers) names them for the report.
    const std::string transport = transports_of(*ctx);
    const bool reduces = c.coll == Collective::kAllreduce || c.coll == Collective::kReduceScatter;
    if (rank == 0) {
      std::printf(
          "# gradsync-bench %s: %d ranks, transport %s, dtype %s, op %s, algo %s, "
          "iters %d, warmup %d%s\n",
          c.coll_name.c_str(), n, transport.c_str(), gradsync::to_string(c.dtype),
          reduces ? gradsync::to_string(c.op) : "-", gradsync::to_string(c.algo), c.iters, c.warmup,
          c.check ? ", check" : "");
      std::printf("# cost model: %s\n# topology: %s\n", ctx->cost_model().c_str(),
                  ctx->topology().c_str());
      if (!c.codec.empty()) {
        std::printf("# codec: %s (algo column); wire(x) = sent/rank / (2(n-1)/n x size)\n",
                    gradsync::compress::make_codec(c.codec)->spec().c_str());
      }
      std::printf(
          "# time: mean per call over the timed loop, max over ranks; "
          "sent/rank: bytes sent per call, max over ranks\n#\n");
      std::printf("# %12s %12s %9s %6s %8s %10s %11s %11s %7s %14s%s\n", "size(B)", "count", "type",
                  "redop", "algo", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong",
                  "sent/rank(B)", c.codec.empty() ? "" : "  wire(x)");
      std::fflush(stdout);
    }

    Bench bench(c, *ctx);
    std::vector<Record> recs;
    std::uint64_t wrong_total = 0;
    double busbw_sum = 0;
    // A next size past max_bytes ends the sweep before bytes * factor could wrap around.
    const auto next = [&c](std::size_t bytes) {
      return bytes > c.max_bytes / c.factor ? c.max_bytes + 1 : bytes * c.factor;
    };
    for (std::size_t bytes = c.min_bytes; bytes <= c.max_bytes; bytes = next(bytes)) {
      // Sizes that round down to the size already measured (below one element, or below
      // one element per rank) would only repeat the previous row.
      if (!recs.empty() && bench.effective_bytes(bytes) == recs.back().bytes) continue;
      Record r = bench.run(bytes);
      recs.push_back(r);
      wrong_total += r.wrong;
      busbw_sum += r.busbw_gbps;
      if (rank == 0) {
        std::printf("  %12zu %12zu %9s %6s %8s %10.1f %11.3f %11.3f %7s %14.0f", r.bytes, r.count,
                    gradsync::to_string(c.dtype), reduces ? gradsync::to_string(c.op) : "-",
                    r.algo.c_str(), r.time_us, r.algbw_gbps, r.busbw_gbps,
                    c.check ? std::to_string(r.wrong).c_str() : "n/a", r.bytes_sent_per_rank);
        if (!c.codec.empty()) std::printf("  %7.3f", wire_ratio(r, n));
        std::printf("\n");
        std::fflush(stdout);
      }
      if (bytes == 0) break;  // --min-bytes 0 would never grow
    }
    if (rank == 0) {
      std::printf("# out of bounds values: %llu %s\n", static_cast<unsigned long long>(wrong_total),
                  c.check ? (wrong_total ? "FAILED" : "OK") : "(not checked)");
      std::printf("# avg bus bandwidth: %.3f GB/s\n",
                  recs.empty() ? 0.0 : busbw_sum / static_cast<double>(recs.size()));
      if (!c.json.empty() && !write_json(c, recs, transport, n, ctx->hosts())) return 1;
    }
    return wrong_total ? 1 : 0;
  } catch (const std::bad_alloc&) {  // the sizes were checked against memory; others use it too
    std::fprintf(stderr,
                 "gradsync-bench: %sout of memory for --max-bytes %zu: lower it, or run fewer "
                 "ranks on this host\n",
                 rank >= 0 ? ("rank " + std::to_string(rank) + ": ").c_str() : "", c.max_bytes);
    return 1;
  } catch (const std::exception& e) {  // gradsync::Error names rank, peer, op and bytes
    std::fprintf(stderr, "gradsync-bench: %s%s\n", rank_prefix(rank, e).c_str(), e.what());
    return 1;
  }
}
