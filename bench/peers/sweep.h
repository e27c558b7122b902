// What the peer benchmarks (MPI, Gloo) share with gradsync-bench: the size sweep and its
// flags, the timing rule, the exact float32 inputs, buffers placed on a page (placed_buffer.h),
// and the table and JSON records they print (through gradsync-bench's JSON writer), so that
// run_peers.sh compares like with like.
// Header-only; depends on no communication library.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "json_writer.h"
#include "placed_buffer.h"

namespace peers {

struct Sweep {
  std::size_t min_bytes = 4096;
  std::size_t max_bytes = std::size_t{64} << 20;
  std::size_t factor = 2;
  int iters = 20;
  int warmup = 5;
  bool check = false;
  std::string json;   // rank 0 writes records here
  std::string label;  // names the implementation in the table and JSON ("mpi", "gloo-ring", ...)
  std::size_t offset = 0;  // buffers start this many bytes past a page (gradsync-bench --offset)
};

[[noreturn]] inline void usage_error(const char* prog, const std::string& msg, const char* usage) {
  std::fprintf(stderr, "%s: %s\n%s", prog, msg.c_str(), usage);
  std::exit(2);
}

// "4096", "4K", "64M", "1G" (powers of 1024, as gradsync-bench).
inline bool parse_bytes(const std::string& v, std::size_t* out) {
  char* end = nullptr;
  errno = 0;
  unsigned long long x = std::strtoull(v.c_str(), &end, 10);
  if (v.empty() || end == v.c_str() || errno != 0) return false;
  std::string s = end;
  int shift = 0;
  if (s == "K" || s == "k" || s == "KiB")
    shift = 10;
  else if (s == "M" || s == "m" || s == "MiB")
    shift = 20;
  else if (s == "G" || s == "g" || s == "GiB")
    shift = 30;
  else if (!s.empty())
    return false;
  *out = static_cast<std::size_t>(x) << shift;
  return true;
}

// Consumes argv[i] (and its value) if it is a sweep flag; returns false if it is not.
inline bool parse_sweep_flag(int argc, char** argv, int& i, Sweep& s, const char* prog,
                             const char* usage) {
  std::string a = argv[i];
  auto value = [&]() -> std::string {
    if (i + 1 >= argc) usage_error(prog, a + " needs a value", usage);
    return argv[++i];
  };
  auto positive = [&](const std::string& v, int lo) {
    char* end = nullptr;
    long x = std::strtol(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || x < lo || x > (1 << 30)) {
      usage_error(prog, a + " expects an integer >= " + std::to_string(lo), usage);
    }
    return static_cast<int>(x);
  };
  if (a == "--min-bytes" || a == "--max-bytes") {
    std::string v = value();
    if (!parse_bytes(v, a == "--min-bytes" ? &s.min_bytes : &s.max_bytes)) {
      usage_error(prog, a + ": bad size '" + v + "'", usage);
    }
  } else if (a == "--factor") {
    s.factor = static_cast<std::size_t>(positive(value(), 2));
  } else if (a == "--iters") {
    s.iters = positive(value(), 1);
  } else if (a == "--warmup") {
    s.warmup = positive(value(), 0);
  } else if (a == "--check") {
    s.check = true;
  } else if (a == "--json") {
    s.json = value();
  } else if (a == "--label") {
    s.label = value();
  } else if (a == "--offset") {
    const int offset = positive(value(), 0);
    constexpr std::size_t kPage = gradsync::tools::PlacedBuffer<float>::kPageBytes;
    if (static_cast<std::size_t>(offset) >= kPage || offset % sizeof(float) != 0) {
      usage_error(prog, a + " expects a multiple of 4 below " + std::to_string(kPage), usage);
    }
    s.offset = static_cast<std::size_t>(offset);
  } else {
    return false;
  }
  return true;
}

constexpr const char* kSweepUsage =
    "  --min-bytes B --max-bytes B --factor F   sizes B, B*F, ... (default 4K..64M, x2)\n"
    "  --iters N --warmup N    timed and untimed calls per size (default 20, 5)\n"
    "  --check                 verify a result exactly (inputs as gradsync-bench --check)\n"
    "  --json FILE             rank 0 writes one record per size\n"
    "  --label NAME            implementation name in the output\n"
    "  --offset B              buffers start B bytes past a page (default 0)\n";

inline std::vector<std::size_t> sizes(const Sweep& s) {
  std::vector<std::size_t> v;
  for (std::size_t b = s.min_bytes; b <= s.max_bytes; b *= s.factor) {
    v.push_back(b);
    if (b == 0) break;
  }
  return v;
}

// The same exactly representable inputs as gradsync-bench --check: sums of up to 17 ranks of
// these small integers are exact in float32 (and even bfloat16).
inline float input_value(int rank, std::size_t i) {
  return static_cast<float>(((rank + 1) * static_cast<long>(i % 7 + 1)) % 16);
}

inline void fill_input(float* buf, std::size_t count, int rank) {
  for (std::size_t i = 0; i < count; ++i) buf[i] = input_value(rank, i);
}

inline std::uint64_t count_wrong_sum(const float* buf, std::size_t count, int ranks) {
  float expected[7];
  for (std::size_t k = 0; k < 7; ++k) {
    expected[k] = 0;
    for (int r = 0; r < ranks; ++r) expected[k] += input_value(r, k);
  }
  std::uint64_t wrong = 0;
  for (std::size_t i = 0; i < count; ++i) wrong += buf[i] != expected[i % 7];
  return wrong;
}

struct Record {
  std::size_t bytes = 0;
  std::size_t count = 0;
  double time_us = 0;  // mean per call over the timed loop, max over ranks
  double algbw_gbps = 0;
  double busbw_gbps = 0;
  std::uint64_t wrong = 0;
};

// Bus bandwidth as nccl-tests defines it: each rank must send and receive `bus_factor` x
// (n-1)/n of the buffer, whatever the algorithm: 2 for an all-reduce, 1 for an all-gather.
inline Record make_record(std::size_t count, double seconds_per_call, int ranks,
                          std::uint64_t wrong, double bus_factor = 2.0) {
  Record r;
  r.count = count;
  r.bytes = count * sizeof(float);
  r.time_us = seconds_per_call * 1e6;
  r.algbw_gbps = seconds_per_call > 0 ? static_cast<double>(r.bytes) / seconds_per_call / 1e9 : 0;
  r.busbw_gbps = r.algbw_gbps * bus_factor * (ranks - 1) / ranks;
  r.wrong = wrong;
  return r;
}

inline void print_header(const char* prog, const Sweep& s, int ranks, const std::string& extra,
                         const char* op = "sum") {
  std::printf("# %s: %d ranks, %s, dtype float32, op %s, iters %d, warmup %d%s\n", prog, ranks,
              extra.c_str(), op, s.iters, s.warmup, s.check ? ", check" : "");
  std::printf("# time: mean per call over the timed loop, max over ranks\n#\n");
  std::printf("# %12s %12s %10s %11s %11s %7s\n", "size(B)", "count", "time(us)", "algbw(GB/s)",
              "busbw(GB/s)", "#wrong");
  std::fflush(stdout);
}

inline void print_row(const Sweep& s, const Record& r) {
  std::printf("  %12zu %12zu %10.1f %11.3f %11.3f %7s\n", r.bytes, r.count, r.time_us, r.algbw_gbps,
              r.busbw_gbps, s.check ? std::to_string(r.wrong).c_str() : "n/a");
  std::fflush(stdout);
}

// Same fields as gradsync-bench's records, plus "impl".
inline void write_json(const Sweep& s, const std::vector<Record>& recs, const std::string& algo,
                       const std::string& transport, int ranks,
                       const char* collective = "allreduce", const char* dtype = "float32") {
  std::ofstream f(s.json);
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", s.json.c_str());
    return;
  }
  gradsync::json::Writer w(f);
  w.begin_array();
  for (const Record& r : recs) {
    w.begin_object()
        .field("collective", collective)
        .field("impl", s.label)
        .field("algo", algo)
        .field("transport", transport)
        .field("ranks", ranks)
        .field("bytes", r.bytes)
        .field("count", r.count)
        .field("dtype", dtype)
        .field("time_us", r.time_us)
        .field("algbw_gbps", r.algbw_gbps)
        .field("busbw_gbps", r.busbw_gbps)
        .field("wrong", r.wrong)
        .end_object();
  }
  w.end_array();
}

}  // namespace peers
