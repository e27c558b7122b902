// Micro-benchmarks of the reduction and conversion kernels against memcpy of the same size.
// bytes_per_second is the payload (one operand's bytes, or the float side of a conversion);
// the `traffic` counter is every byte read plus written, the figure to hold against memory
// bandwidth (reduce_into reads dst and src and writes dst: 3x payload; memcpy 2x).
// Run: kernels_bench --benchmark_min_time=0.1   (arg "scalar" = forced scalar path)
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/kernels.h"

namespace gradsync::kernels {
namespace {

constexpr std::size_t kCacheBytes = 64 << 10;   // 64 KiB per operand: both fit in L2
constexpr std::size_t kMemoryBytes = 64 << 20;  // 64 MiB per operand: well beyond L3

std::vector<unsigned char> random_bytes(std::size_t n, DataType t) {
  std::vector<unsigned char> v(n);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  const std::size_t sz = dtype_size(t);
  for (std::size_t i = 0; i + sz <= n; i += sz) {
    const float f = dist(rng);
    switch (t) {
      case DataType::kFloat16: {
        const std::uint16_t h = float_to_half(f);
        std::memcpy(&v[i], &h, 2);
        break;
      }
      case DataType::kBFloat16: {
        const std::uint16_t h = float_to_bfloat16(f);
        std::memcpy(&v[i], &h, 2);
        break;
      }
      default: std::memcpy(&v[i], &f, sz < 4 ? sz : 4); break;
    }
  }
  return v;
}

void set_rates(benchmark::State& state, std::size_t payload, std::size_t traffic) {
  const auto iters = static_cast<std::int64_t>(state.iterations());
  state.SetBytesProcessed(iters * static_cast<std::int64_t>(payload));
  state.counters["traffic"] = benchmark::Counter(static_cast<double>(traffic) * static_cast<double>(iters),
                                                 benchmark::Counter::kIsRate,
                                                 benchmark::Counter::OneK::kIs1024);
}

void BM_ReduceInto(benchmark::State& state, DataType t, std::size_t bytes, bool scalar) {
  force_scalar(scalar);
  state.SetLabel(isa_name());
  auto dst = random_bytes(bytes, t);
  const auto src = random_bytes(bytes, t);
  // Adding src and then -src keeps dst bounded, so the scalar half path (whose cost depends
  // on the values) sees ordinary numbers however many iterations run.
  auto neg = src;
  const std::size_t sz = dtype_size(t);
  for (std::size_t i = sz - 1; i < neg.size(); i += sz) neg[i] ^= 0x80;  // flip sign bits
  const std::size_t count = bytes / sz;
  bool flip = false;
  for (auto _ : state) {
    reduce_into(dst.data(), flip ? neg.data() : src.data(), count, t, ReduceOp::kSum);
    flip = !flip;
    benchmark::ClobberMemory();
  }
  set_rates(state, bytes, 3 * bytes);
  force_scalar(false);
}

void BM_FloatToHalf(benchmark::State& state, std::size_t count, bool scalar) {
  force_scalar(scalar);
  state.SetLabel(isa_name());
  std::vector<float> src(count, 0.3f);
  std::vector<std::uint16_t> dst(count);
  for (auto _ : state) {
    float_to_half(src.data(), dst.data(), count);
    benchmark::ClobberMemory();
  }
  set_rates(state, count * 4, count * 6);
  force_scalar(false);
}

void BM_HalfToFloat(benchmark::State& state, std::size_t count, bool scalar) {
  force_scalar(scalar);
  state.SetLabel(isa_name());
  std::vector<std::uint16_t> src(count, 0x3555);
  std::vector<float> dst(count);
  for (auto _ : state) {
    half_to_float(src.data(), dst.data(), count);
    benchmark::ClobberMemory();
  }
  set_rates(state, count * 4, count * 6);
  force_scalar(false);
}

void BM_FloatToBFloat16(benchmark::State& state, std::size_t count) {
  std::vector<float> src(count, 0.3f);
  std::vector<std::uint16_t> dst(count);
  for (auto _ : state) {
    float_to_bfloat16(src.data(), dst.data(), count);
    benchmark::ClobberMemory();
  }
  set_rates(state, count * 4, count * 6);
}

void BM_Memcpy(benchmark::State& state, std::size_t bytes) {
  std::vector<unsigned char> src(bytes, 1), dst(bytes);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::ClobberMemory();
  }
  set_rates(state, bytes, 2 * bytes);
}

BENCHMARK_CAPTURE(BM_Memcpy, 64KiB, kCacheBytes);
BENCHMARK_CAPTURE(BM_ReduceInto, f32_sum_64KiB, DataType::kFloat32, kCacheBytes, false);
BENCHMARK_CAPTURE(BM_ReduceInto, f32_sum_64KiB_scalar, DataType::kFloat32, kCacheBytes, true);
BENCHMARK_CAPTURE(BM_ReduceInto, f16_sum_64KiB, DataType::kFloat16, kCacheBytes, false);
BENCHMARK_CAPTURE(BM_ReduceInto, f16_sum_64KiB_scalar, DataType::kFloat16, kCacheBytes, true);
BENCHMARK_CAPTURE(BM_ReduceInto, bf16_sum_64KiB, DataType::kBFloat16, kCacheBytes, false);
BENCHMARK_CAPTURE(BM_ReduceInto, bf16_sum_64KiB_scalar, DataType::kBFloat16, kCacheBytes, true);

BENCHMARK_CAPTURE(BM_Memcpy, 64MiB, kMemoryBytes);
BENCHMARK_CAPTURE(BM_ReduceInto, f32_sum_64MiB, DataType::kFloat32, kMemoryBytes, false);
BENCHMARK_CAPTURE(BM_ReduceInto, f16_sum_64MiB, DataType::kFloat16, kMemoryBytes, false);
BENCHMARK_CAPTURE(BM_ReduceInto, bf16_sum_64MiB, DataType::kBFloat16, kMemoryBytes, false);

// Conversions: 1M floats (4 MiB, L3-resident) and 16M floats (64 MiB, memory).
BENCHMARK_CAPTURE(BM_Memcpy, 4MiB, std::size_t{4} << 20);
BENCHMARK_CAPTURE(BM_FloatToHalf, 1M, std::size_t{1} << 20, false);
BENCHMARK_CAPTURE(BM_FloatToHalf, 1M_scalar, std::size_t{1} << 20, true);
BENCHMARK_CAPTURE(BM_HalfToFloat, 1M, std::size_t{1} << 20, false);
BENCHMARK_CAPTURE(BM_HalfToFloat, 1M_scalar, std::size_t{1} << 20, true);
BENCHMARK_CAPTURE(BM_FloatToBFloat16, 1M, std::size_t{1} << 20);
BENCHMARK_CAPTURE(BM_FloatToHalf, 16M, std::size_t{16} << 20, false);
BENCHMARK_CAPTURE(BM_HalfToFloat, 16M, std::size_t{16} << 20, false);

}  // namespace
}  // namespace gradsync::kernels

BENCHMARK_MAIN();
