// The element types and reduce ops beyond the float ones (int8, int16, bool; band, bor,
// bxor) at their edges: numbers and names that must not move, the wire signature, the
// kernels' wrap-around, signed compares and bool-as-logic on both paths, and the refusals (a
// bitwise op on a float type; a compressed all-reduce, which only sums or averages float32).
// The grids of kernels_test, collectives_test and topology_test run them against references.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "collectives/signature.h"
#include "gradsync/compress.h"
#include "harness.h"
#include "kernel_paths.h"
#include "kernels/kernels.h"
#include "reference.h"

namespace gradsync {
namespace {

using testing::contains;
using testing::expect_error;

// The numbers travel in every message's signature and through the C API of bindings: new
// values are appended, old ones keep theirs.
static_assert(static_cast<int>(DataType::kUInt8) == 6);
static_assert(static_cast<int>(DataType::kInt8) == 7);
static_assert(static_cast<int>(DataType::kInt16) == 8);
static_assert(static_cast<int>(DataType::kBool) == 9);
static_assert(static_cast<int>(ReduceOp::kProd) == 4);
static_assert(static_cast<int>(ReduceOp::kBand) == 5);
static_assert(static_cast<int>(ReduceOp::kBor) == 6);
static_assert(static_cast<int>(ReduceOp::kBxor) == 7);

TEST(Dtypes, NamesSizesAndParsers) {
  EXPECT_EQ(dtype_size(DataType::kInt8), 1u);
  EXPECT_EQ(dtype_size(DataType::kInt16), 2u);
  EXPECT_EQ(dtype_size(DataType::kBool), 1u);
  EXPECT_STREQ(to_string(DataType::kInt8), "int8");
  EXPECT_STREQ(to_string(DataType::kInt16), "int16");
  EXPECT_STREQ(to_string(DataType::kBool), "bool");
  EXPECT_STREQ(to_string(ReduceOp::kBand), "band");
  EXPECT_STREQ(to_string(ReduceOp::kBor), "bor");
  EXPECT_STREQ(to_string(ReduceOp::kBxor), "bxor");
  EXPECT_EQ(parse_dtype("i8"), DataType::kInt8);
  EXPECT_EQ(parse_dtype("i16"), DataType::kInt16);
  EXPECT_EQ(parse_dtype("int16"), DataType::kInt16);
  EXPECT_EQ(parse_dtype("bool"), DataType::kBool);
  EXPECT_EQ(parse_dtype("int4"), std::nullopt);
  EXPECT_EQ(parse_op("and"), std::nullopt);
  for (DataType t : testing::kAllDtypes) {
    EXPECT_NE(dtype_size(t), 0u) << to_string(t);
    EXPECT_EQ(parse_dtype(to_string(t)), t) << to_string(t);
  }
  for (ReduceOp op : testing::kAllOps) EXPECT_EQ(parse_op(to_string(op)), op) << to_string(op);
}

TEST(Dtypes, BitwiseOpsAreValidOnIntegersAndBoolOnly) {
  for (DataType t : testing::kAllDtypes) {
    const bool floating = t == DataType::kFloat32 || t == DataType::kFloat64 ||
                          t == DataType::kFloat16 || t == DataType::kBFloat16;
    EXPECT_EQ(is_floating(t), floating) << to_string(t);
    for (ReduceOp op : testing::kAllOps) {
      EXPECT_EQ(dtype_op_valid(t, op), !(floating && testing::is_bitwise(op)))
          << to_string(t) << " " << to_string(op);
    }
  }
  EXPECT_FALSE(dtype_op_valid(static_cast<DataType>(42), ReduceOp::kSum));
  EXPECT_FALSE(dtype_op_valid(DataType::kInt32, static_cast<ReduceOp>(8)));
}

TEST(Dtypes, SignatureCarriesAndNamesEveryDtypeAndOp) {
  for (DataType t : testing::kAllDtypes) {
    for (ReduceOp op : testing::kAllOps) {
      const collectives::CallSignature sig{
          7, collectives::CollectiveKind::kAllreduce, t, op, Algorithm::kRing, -1, 99, 3};
      const collectives::CallSignature back = collectives::decode(collectives::encode(sig));
      EXPECT_EQ(back.dtype, t);
      EXPECT_EQ(back.op, op);
      EXPECT_EQ(back.kind, sig.kind);
      EXPECT_EQ(back.algorithm, sig.algorithm);
      EXPECT_EQ(back.root, -1);
      EXPECT_EQ(back.count, 99u);
      EXPECT_EQ(back.step, 3u);
      const std::string text = collectives::describe(back);
      EXPECT_TRUE(contains(text, std::string(" ") + to_string(t) + " " + to_string(op) + " "))
          << text;
    }
  }
}

// ---------------------------------------------------------------- kernels

// Both kernel paths (the vector one where the CPU has it); the scalar one is forced.
template <class Fn>
void on_both_paths(Fn fn) {
  for (bool scalar : kernels::paths()) {
    kernels::ScopedScalar path(scalar);
    SCOPED_TRACE(scalar ? "scalar" : kernels::isa_name());
    fn();
  }
}

TEST(DtypeKernels, BoolIsLogicAndAlwaysWritesZeroOrOne) {
  on_both_paths([] {
    // Every pair of {0, 1, 2, 255}, the last two being stray bytes that mean true; 16 pairs
    // twice over, past one vector of 32 bytes and into a tail.
    std::vector<std::uint8_t> a, b;
    for (int k = 0; k < 40; ++k) {
      const std::uint8_t v[4] = {0, 1, 2, 255};
      a.push_back(v[k % 4]);
      b.push_back(v[(k / 4) % 4]);
    }
    std::vector<std::uint8_t> r(a.size());
    const auto check = [&](ReduceOp op, auto logic) {
      kernels::reduce(r.data(), a.data(), b.data(), a.size(), DataType::kBool, op);
      for (std::size_t i = 0; i < a.size(); ++i) {
        const bool want = logic(a[i] != 0, b[i] != 0);
        ASSERT_EQ(r[i], want ? 1 : 0) << to_string(op) << " of " << int{a[i]} << ", " << int{b[i]};
      }
    };
    const auto any = [](bool x, bool y) { return x || y; };
    const auto all = [](bool x, bool y) { return x && y; };
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kBor}) {
      check(op, any);
    }
    for (ReduceOp op : {ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kBand}) check(op, all);
    check(ReduceOp::kBxor, [](bool x, bool y) { return x != y; });
  });
}

TEST(DtypeKernels, NarrowIntegersWrapAndCompareSigned) {
  on_both_paths([] {
    constexpr std::size_t n = 35;
    std::int8_t a8[n], b8[n], r8[n];
    std::int16_t a16[n], b16[n], r16[n];
    for (std::size_t i = 0; i < n; ++i) {
      a8[i] = 127;
      b8[i] = 1;
      a16[i] = -32768;
      b16[i] = -1;
    }
    kernels::reduce(r8, a8, b8, n, DataType::kInt8, ReduceOp::kSum);
    kernels::reduce(r16, a16, b16, n, DataType::kInt16, ReduceOp::kSum);
    EXPECT_EQ(r8[n - 1], -128);
    EXPECT_EQ(r16[n - 1], 32767);
    // 65535 * 65535 would overflow int, where uint16 promotes: the low 16 bits, no UB.
    for (std::size_t i = 0; i < n; ++i) a16[i] = b16[i] = -1;  // 0xFFFF
    kernels::reduce(r16, a16, b16, n, DataType::kInt16, ReduceOp::kProd);
    EXPECT_EQ(r16[0], 1);
    for (std::size_t i = 0; i < n; ++i) {
      a16[i] = 300;
      b16[i] = 300;  // 90000 mod 65536 = 24464
    }
    kernels::reduce(r16, a16, b16, n, DataType::kInt16, ReduceOp::kProd);
    EXPECT_EQ(r16[n - 1], 24464);
    a8[0] = -5;
    b8[0] = 3;
    kernels::reduce(r8, a8, b8, 1, DataType::kInt8, ReduceOp::kMin);
    EXPECT_EQ(r8[0], -5);  // signed: 0xFB is not above 3
    kernels::reduce(r8, a8, b8, 1, DataType::kInt8, ReduceOp::kMax);
    EXPECT_EQ(r8[0], 3);
    a16[0] = -300;
    b16[0] = 200;
    kernels::reduce(r16, a16, b16, 1, DataType::kInt16, ReduceOp::kMin);
    EXPECT_EQ(r16[0], -300);
  });
}

TEST(DtypeKernels, BitwiseOpsActOnTheBitsOfEveryIntegerWidth) {
  on_both_paths([] {
    constexpr std::size_t n = 37;  // a vector of 32 bytes and a tail, for the 1-byte types
    std::vector<std::int64_t> a(n), b(n);
    for (std::size_t i = 0; i < n; ++i) {
      a[i] = static_cast<std::int64_t>(0xF0F0F0F00FF00FF0ull ^ (i * 0x0101010101010101ull));
      b[i] = static_cast<std::int64_t>(0x3C3C3C3CA5A5A5A5ull + i);
    }
    for (DataType t : {DataType::kUInt8, DataType::kInt8, DataType::kInt16, DataType::kInt32,
                       DataType::kInt64}) {
      const std::size_t es = dtype_size(t);
      // Each element's low bytes (little-endian), packed at the dtype's width.
      std::vector<unsigned char> x(n * es), y(n * es), r(n * es), want(n * es);
      for (std::size_t i = 0; i < n; ++i) {
        std::memcpy(&x[i * es], &a[i], es);
        std::memcpy(&y[i * es], &b[i], es);
      }
      for (ReduceOp op : {ReduceOp::kBand, ReduceOp::kBor, ReduceOp::kBxor}) {
        for (std::size_t i = 0; i < n; ++i) {
          const std::int64_t v = op == ReduceOp::kBand  ? a[i] & b[i]
                                 : op == ReduceOp::kBor ? a[i] | b[i]
                                                        : a[i] ^ b[i];
          std::memcpy(&want[i * es], &v, es);
        }
        kernels::reduce(r.data(), x.data(), y.data(), n, t, op);
        EXPECT_TRUE(r == want) << to_string(t) << " " << to_string(op);
      }
    }
  });
}

TEST(DtypeKernels, AverageOfNarrowIntegersAndBoolTruncates) {
  on_both_paths([] {
    std::int8_t i8[3] = {-7, 127, -128};
    kernels::scale_for_average(i8, 3, DataType::kInt8, 2);
    EXPECT_EQ(i8[0], -3);  // toward zero
    EXPECT_EQ(i8[1], 63);
    EXPECT_EQ(i8[2], -64);
    std::int16_t i16[2] = {-32768, 32767};
    kernels::scale_for_average(i16, 2, DataType::kInt16, 3);
    EXPECT_EQ(i16[0], -10922);
    EXPECT_EQ(i16[1], 10922);
    // An average of bools is the OR divided as an integer: false for two ranks or more.
    std::uint8_t b[2] = {1, 0};
    kernels::scale_for_average(b, 2, DataType::kBool, 1);
    EXPECT_EQ(b[0], 1);
    kernels::scale_for_average(b, 2, DataType::kBool, 2);
    EXPECT_EQ(b[0], 0);
    EXPECT_EQ(b[1], 0);
  });
}

TEST(DtypeKernels, BitwiseOpOnAFloatIsRefusedNamingBoth) {
  float x[1] = {1.0f};
  for (DataType t :
       {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16}) {
    for (ReduceOp op : {ReduceOp::kBand, ReduceOp::kBor, ReduceOp::kBxor}) {
      const Error e = expect_error(ErrorKind::kInvalidArgument, [&] {
        kernels::reduce(x, x, x, 0, t, op);  // even an empty call
      });
      EXPECT_TRUE(contains(e.what(), to_string(t))) << e.what();
      EXPECT_TRUE(contains(e.what(), to_string(op))) << e.what();
    }
  }
}

// ---------------------------------------------------------------- compressed all-reduce

// Gradients are float32 by the API's types; of the ops, a codec's pattern can only sum (or
// sum and divide): the others, bitwise ones included, are refused at the call, naming the op.
TEST(DtypeCompress, CompressedAllreduceRefusesEveryOpButSumAndAvg) {
  testing::run_inproc_contexts(2, [](Context& ctx) {
    for (const char* spec : {"none", "int8"}) {
      auto codec = compress::make_codec(spec);
      std::vector<float> data(16, 1.0f);
      for (ReduceOp op : testing::kAllOps) {
        if (op == ReduceOp::kSum || op == ReduceOp::kAvg) continue;
        const Error e = expect_error(ErrorKind::kInvalidArgument, [&] {
          compress::compressed_allreduce(ctx, data, *codec, "w", op);
        });
        EXPECT_TRUE(contains(e.what(), std::string("not ") + to_string(op))) << e.what();
      }
      compress::compressed_allreduce(ctx, data, *codec, "w", ReduceOp::kSum);
      EXPECT_NEAR(data[0], 2.0f, 1e-3f) << spec;  // the refusals left the ranks in step
    }
  });
}

}  // namespace
}  // namespace gradsync
