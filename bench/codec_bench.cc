// Gradient codecs through the public API (include/gradsync/compress.h), encode and decode
// timed separately, beside memcpy of the same bytes and the conversion kernels, at 1M, 16M
// and 64M floats; and the codec kernels (src/kernels/) at the same sizes.
// bytes_per_second is always the INPUT float32 bytes (count * 4) per call on one thread, so
// every row reads as "gradient bytes a core gets through per second"; payload_ratio is the
// encoded size over those bytes (the last call's: with error feedback on, every call encodes
// the same gradient again and the residual grows as if a step repeated, so a threshold
// codec's payload drifts). Specs make_codec refuses (not implemented yet) are skipped when
// benchmarks are registered, with a note on stderr.
// Run: codec_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
//      (bench/codecs/run_codec_bench.sh does that and sets the results beside PyTorch's)
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "gradsync/compress.h"
#include "gradsync/error.h"
#include "kernels/kernels.h"

namespace gradsync {
namespace {

constexpr std::size_t kSizes[] = {std::size_t{1} << 20, std::size_t{16} << 20,
                                  std::size_t{64} << 20};

// Default error feedback is part of what a codec costs in training, so specs run as
// written; each also runs with ef=0 where that is a different codec.
const char* const kSpecs[] = {"fp16",
                              "bf16",
                              "int8",
                              "qsgd:levels=127",
                              "topk:ratio=0.01",
                              "topk:ratio=0.01,exact=1",
                              "randomk:ratio=0.01",
                              "threshold:rel=0.1",
                              "sign",
                              "powersgd:rank=4"};

std::string size_name(std::size_t n) {
  return std::to_string(n >> 20) + "M";
}

// Gradient-like values: normal(0, 1e-3) with one outlier of 0.05..0.5 in about 10^4, the
// shape that decides how much top-k, threshold and per-block scales keep. The generator
// extends the same stream, so every size sees a prefix of the same data.
std::span<const float> gradient(std::size_t n) {
  static std::vector<float> data;
  static std::mt19937_64 rng(20240917);
  if (data.size() < n) {
    std::normal_distribution<float> normal(0.0f, 1e-3f);
    std::uniform_real_distribution<float> outlier(0.05f, 0.5f);
    data.reserve(n);
    while (data.size() < n) {
      const float v = normal(rng);
      data.push_back(rng() % 10000 == 0 ? std::copysign(outlier(rng), v) : v);
    }
  }
  return {data.data(), n};
}

void set_rate(benchmark::State& state, std::size_t count) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(count * 4));
}

// Large tensors: few iterations (each call already streams hundreds of MiB), so all of the
// sizes and repetitions finish in minutes.
void limit_time(benchmark::internal::Benchmark* b, std::size_t count) {
  b->Unit(benchmark::kMillisecond)->MinTime(count >= (std::size_t{64} << 20) ? 0.1 : 0.2);
}

// ---------------------------------------------------------------- codecs

bool is_matrix_codec(const std::string& spec) {
  return spec.rfind("powersgd", 0) == 0;
}

// One tensor name per size (codec state is kept per name). PowerSGD compresses matrices: it
// gets the square one of n elements (1024^2, 4096^2, 8192^2), as a layer's weight would be.
compress::Tensor tensor_for(const std::string& spec, std::size_t n) {
  std::size_t rows = 0;
  if (is_matrix_codec(spec)) {
    rows = static_cast<std::size_t>(std::sqrt(static_cast<double>(n)));
  }
  return compress::Tensor("bench." + size_name(n), rows);
}

void BM_Encode(benchmark::State& state, const std::string& spec, std::size_t n) {
  auto codec = compress::make_codec(spec);
  state.SetLabel(codec->spec());
  const auto in = gradient(n);
  const compress::Tensor tensor = tensor_for(spec, n);
  std::vector<std::uint8_t> out;
  codec->encode(tensor, in, out);  // allocates the payload and any error-feedback state
  for (auto _ : state) {
    codec->encode(tensor, in, out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_rate(state, n);
  state.counters["payload_ratio"] = static_cast<double>(out.size()) / static_cast<double>(n * 4);
}

void BM_Decode(benchmark::State& state, const std::string& spec, std::size_t n) {
  auto codec = compress::make_codec(spec);
  state.SetLabel(codec->spec());
  const compress::Tensor tensor = tensor_for(spec, n);
  std::vector<std::uint8_t> payload;
  codec->encode(tensor, gradient(n), payload);
  std::vector<float> out(n);
  codec->decode(payload, out);  // faults the output pages in
  for (auto _ : state) {
    codec->decode(payload, out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_rate(state, n);
  state.counters["payload_ratio"] =
      static_cast<double>(payload.size()) / static_cast<double>(n * 4);
}

// The codec `spec` names, or null (with a note) when make_codec does not take it.
std::unique_ptr<compress::Codec> try_codec(const std::string& spec, bool quiet) {
  try {
    return compress::make_codec(spec);
  } catch (const Error& e) {
    if (!quiet) std::fprintf(stderr, "codec_bench: skipping %s: %s\n", spec.c_str(), e.what());
    return nullptr;
  }
}

void register_codec(const std::string& spec) {
  for (std::size_t n : kSizes) {
    limit_time(benchmark::RegisterBenchmark(("encode/" + spec + "/" + size_name(n)).c_str(),
                                            BM_Encode, spec, n),
               n);
    limit_time(benchmark::RegisterBenchmark(("decode/" + spec + "/" + size_name(n)).c_str(),
                                            BM_Decode, spec, n),
               n);
  }
}

void register_codecs() {
  for (const std::string spec : kSpecs) {
    const auto codec = try_codec(spec, false);
    if (codec == nullptr) continue;
    register_codec(spec);
    const std::string no_ef = spec + (spec.find(':') == std::string::npos ? ":" : ",") + "ef=0";
    const auto plain = try_codec(no_ef, true);
    if (plain != nullptr && plain->spec() != codec->spec()) register_codec(no_ef);
  }
}

// ---------------------------------------------------------------- baselines and kernels

void BM_Memcpy(benchmark::State& state, std::size_t n) {
  const auto in = gradient(n);
  std::vector<float> out(n);
  for (auto _ : state) {
    std::memcpy(out.data(), in.data(), n * 4);
    benchmark::ClobberMemory();
  }
  set_rate(state, n);
}

// Buffers a kernel benchmark writes or reads besides the gradient, allocated for one run
// (64M floats of them are half a GiB) and filled with that gradient's encodings, so the
// decoding kernels read real payloads.
struct Buffers {
  std::vector<std::uint16_t> half, bf16;
  std::vector<float> floats, scales;
  std::vector<std::int8_t> q;
  std::vector<std::uint8_t> bits;
  explicit Buffers(std::span<const float> in)
      : half(in.size()),
        bf16(in.size()),
        floats(in.size()),
        scales(in.size() / 256 + 1),
        q(in.size()),
        bits(in.size() / 8 + 1) {
    kernels::float_to_half(in.data(), half.data(), in.size());
    kernels::float_to_bfloat16(in.data(), bf16.data(), in.size());
    kernels::quantize_int8_blocks(in.data(), in.size(), 256, scales.data(), q.data());
    kernels::pack_signs(in.data(), in.size(), bits.data());
  }
};

using KernelFn = void (*)(std::span<const float>, Buffers&);

// One kernel call per iteration over n floats of the gradient; `scalar` forces that path.
void BM_Kernel(benchmark::State& state, KernelFn fn, std::size_t n, bool scalar) {
  const auto in = gradient(n);
  Buffers buffers(in);
  kernels::force_scalar(scalar);
  state.SetLabel(kernels::isa_name());
  fn(in, buffers);  // warm-up
  for (auto _ : state) {
    fn(in, buffers);
    benchmark::ClobberMemory();
  }
  set_rate(state, n);
  kernels::force_scalar(false);
}

void register_kernels() {
  struct Kernel {
    const char* name;
    KernelFn fn;
  };
  static const Kernel kKernels[] = {
      {"float_to_half",
       [](std::span<const float> in, Buffers& b) {
         kernels::float_to_half(in.data(), b.half.data(), in.size());
       }},
      {"half_to_float",
       [](std::span<const float> in, Buffers& b) {
         kernels::half_to_float(b.half.data(), b.floats.data(), in.size());
       }},
      {"float_to_bfloat16",
       [](std::span<const float> in, Buffers& b) {
         kernels::float_to_bfloat16(in.data(), b.half.data(), in.size());
       }},
      {"bfloat16_to_float",
       [](std::span<const float> in, Buffers& b) {
         kernels::bfloat16_to_float(b.bf16.data(), b.floats.data(), in.size());
       }},
      // qsgd's default block and levels; the key changes nothing about the work.
      {"quantize_stochastic_int8_blocks",
       [](std::span<const float> in, Buffers& b) {
         kernels::quantize_stochastic_int8_blocks(in.data(), in.size(), 512, 127, 42,
                                                  b.scales.data(), b.q.data());
       }},
      {"quantize_int8_blocks",
       [](std::span<const float> in, Buffers& b) {
         kernels::quantize_int8_blocks(in.data(), in.size(), 256, b.scales.data(), b.q.data());
       }},
      {"dequantize_int8_blocks",
       [](std::span<const float> in, Buffers& b) {
         kernels::dequantize_int8_blocks(b.q.data(), b.scales.data(), in.size(), 256,
                                         b.floats.data());
       }},
      {"pack_signs", [](std::span<const float> in,
                        Buffers& b) { kernels::pack_signs(in.data(), in.size(), b.bits.data()); }},
      {"unpack_signs_scaled",
       [](std::span<const float> in, Buffers& b) {
         kernels::unpack_signs_scaled(b.bits.data(), in.size(), 1e-3f, b.floats.data(), false);
       }},
      {"sum_abs",
       [](std::span<const float> in, Buffers&) {
         benchmark::DoNotOptimize(kernels::sum_abs(in.data(), in.size()));
       }},
      {"max_abs",
       [](std::span<const float> in, Buffers&) {
         benchmark::DoNotOptimize(kernels::max_abs(in.data(), in.size()));
       }},
      {"first_non_finite",
       [](std::span<const float> in, Buffers&) {
         benchmark::DoNotOptimize(kernels::first_non_finite(in.data(), in.size()));
       }},
  };
  const auto add = [](const Kernel& k, std::size_t n, bool scalar) {
    const std::string name =
        std::string("kernel/") + k.name + "/" + size_name(n) + (scalar ? "/scalar" : "");
    limit_time(benchmark::RegisterBenchmark(name.c_str(), BM_Kernel, k.fn, n, scalar), n);
  };
  for (std::size_t n : kSizes) {
    limit_time(benchmark::RegisterBenchmark(("memcpy/" + size_name(n)).c_str(), BM_Memcpy, n), n);
    for (const Kernel& k : kKernels) add(k, n, false);
  }
  // The scalar fallback at one size, for the speed-up the vector path buys.
  for (const Kernel& k : kKernels) add(k, kSizes[1], true);
}

}  // namespace
}  // namespace gradsync

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  gradsync::register_kernels();
  gradsync::register_codecs();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
