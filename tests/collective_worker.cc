// A rank of the multi-process tests, started by gradsync-run: builds its context from the
// environment like a user program, then either checks every collective against the
// reference (mode "check") or all-reduces until killed (mode "loop", for kill -9 tests).
// Exit code 0 = every check passed.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <numeric>
#include <string>
#include <tuple>

#include "gradsync/gradsync.h"
#include "reference.h"

using namespace gradsync;

namespace {

int failures = 0;

void check(bool ok, const std::string& what, int rank) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "rank %d: FAILED %s\n", rank, what.c_str());
  }
}

// gather, scatter, alltoall(v) and a ring of sends and recvs, async where the call has a form
// that is, at sizes that fit the transports' buffers and sizes that do not.
void run_block_and_p2p_checks(Context& ctx) {
  const int n = ctx.size(), r = ctx.rank();
  int k = 0;
  for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{300007}}) {
    const std::size_t bytes = count * 4, total = bytes * static_cast<std::size_t>(n);
    const std::string at = " count=" + std::to_string(count);
    for (int root : {0, n - 1}) {
      testing::Buffer mine = testing::pattern(r, root, bytes, k), all(total);
      ctx.gather(mine.data(), r == root ? all.data() : nullptr, count, DataType::kFloat32, root);
      for (int src = 0; r == root && src < n; ++src) {
        check(testing::holds_at(all, static_cast<std::size_t>(src) * bytes,
                                testing::pattern(src, root, bytes, k)),
              "gather" + at, r);
      }
      ++k;
      testing::Buffer from_root;
      for (int dst = 0; r == root && dst < n; ++dst) {
        testing::Buffer b = testing::pattern(root, dst, bytes, k);
        from_root.insert(from_root.end(), b.begin(), b.end());
      }
      testing::Buffer got(bytes);
      ctx.scatter_async(r == root ? from_root.data() : nullptr, got.data(), count,
                        DataType::kFloat32, root)
          .wait();
      check(got == testing::pattern(root, r, bytes, k), "scatter" + at, r);
      ++k;
    }
    testing::Buffer in, out(total);
    for (int dst = 0; dst < n; ++dst) {
      testing::Buffer b = testing::pattern(r, dst, bytes, k);
      in.insert(in.end(), b.begin(), b.end());
    }
    ctx.alltoall(in.data(), out.data(), count, DataType::kFloat32);
    for (int src = 0; src < n; ++src) {
      check(testing::holds_at(out, static_cast<std::size_t>(src) * bytes,
                              testing::pattern(src, r, bytes, k)),
            "alltoall" + at, r);
    }
    ++k;
    // Rank i sends rank j (i + j) % 3 * count elements: some pairs nothing.
    std::vector<std::size_t> send_counts, recv_counts;
    testing::Buffer vin;
    for (int j = 0; j < n; ++j) {
      send_counts.push_back(static_cast<std::size_t>((r + j) % 3) * count);
      recv_counts.push_back(static_cast<std::size_t>((j + r) % 3) * count);
      testing::Buffer b = testing::pattern(r, j, send_counts.back(), k);
      vin.insert(vin.end(), b.begin(), b.end());
    }
    testing::Buffer vout(std::accumulate(recv_counts.begin(), recv_counts.end(), std::size_t{0}));
    ctx.alltoallv_async(vin.data(), send_counts, vout.data(), recv_counts, DataType::kUInt8).wait();
    std::size_t offset = 0;
    for (int src = 0; src < n; ++src) {
      const std::size_t b = recv_counts[static_cast<std::size_t>(src)];
      check(testing::holds_at(vout, offset, testing::pattern(src, r, b, k)), "alltoallv" + at, r);
      offset += b;
    }
    ++k;
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    testing::Buffer sent = testing::pattern(r, next, bytes, k), received(bytes);
    Work s = ctx.send_async(sent.data(), count, DataType::kFloat32, next, 1);
    Work q = ctx.recv_async(received.data(), count, DataType::kFloat32, prev, 1);
    s.wait();
    q.wait();
    check(received == testing::pattern(prev, r, bytes, k), "send/recv ring" + at, r);
    ++k;
  }
}

// Each algorithm runs the same calls: their inputs and references are made once (an exact
// reference of a million elements costs far more than the all-reduce).
class Memo {
 public:
  using Make = testing::Buffer (*)(DataType, ReduceOp, int, std::size_t);
  explicit Memo(Make make) : make_(make) {}
  const testing::Buffer& of(DataType t, ReduceOp op, int who, std::size_t count) {
    auto [it, made] = buffers_.try_emplace({t, op, count});
    if (made) it->second = make_(t, op, who, count);
    return it->second;
  }

 private:
  Make make_;
  std::map<std::tuple<DataType, ReduceOp, std::size_t>, testing::Buffer> buffers_;
};

void run_checks(Context& ctx) {
  const int n = ctx.size(), r = ctx.rank();
  // `who`: this rank for inputs, the world size for references.
  Memo inputs(testing::periodic_input), references(testing::periodic_reference);
  const std::size_t counts[] = {0, 1, static_cast<std::size_t>(n > 1 ? n - 1 : 1), 99991,
                                (std::size_t{1} << 20) + 3};
  for (Algorithm algo : {Algorithm::kAuto, Algorithm::kRing, Algorithm::kRecursiveDoubling,
                         Algorithm::kHalvingDoubling, Algorithm::kParameterServer,
                         Algorithm::kSharedMemory, Algorithm::kHierarchical}) {
    for (std::size_t count : counts) {
      // Processes add the transports and the launcher to what the in-process grids check:
      // the kernels' whole grid once, then each dtype and each op.
      const bool whole_grid = algo == Algorithm::kAuto && count < 100000;
      for (auto [t, op] :
           whole_grid ? testing::every_dtype_op_pair() : testing::each_dtype_and_each_op()) {
        if (count > 100000 && (t != DataType::kFloat32 || op != ReduceOp::kSum)) continue;
        std::string what = std::string("allreduce ") + to_string(algo) + " " + to_string(t) + " " +
                           to_string(op) + " count=" + std::to_string(count);
        const testing::Buffer& in = inputs.of(t, op, r, count);
        testing::Buffer out(in.size());
        ctx.allreduce(in.data(), out.data(), count, t, op, {.algorithm = algo});
        check(out == references.of(t, op, n, count), what, r);
      }
    }
  }
  // Large enough that the hierarchical all-reduce overlaps host-local and host-crossing
  // segments (a thread per side, where the two sides use different transports), in place.
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    const std::size_t count = (std::size_t{3} << 20) + 5;
    testing::Buffer buf = testing::periodic_input(DataType::kFloat32, op, r, count);
    ctx.allreduce(buf.data(), buf.data(), count, DataType::kFloat32, op,
                  {.algorithm = Algorithm::kHierarchical});
    check(buf == testing::periodic_reference(DataType::kFloat32, op, n, count),
          std::string("segmented hierarchical allreduce ") + to_string(op), r);
  }
  for (std::size_t block :
       {std::size_t{0}, std::size_t{1}, std::size_t{4099}, std::size_t{262147}}) {
    const std::size_t total = block * static_cast<std::size_t>(n);
    testing::Buffer in = testing::make_input(DataType::kFloat32, ReduceOp::kSum, r, total);
    testing::Buffer out(block * 4);
    ctx.reduce_scatter(in.data(), out.data(), block, DataType::kFloat32, ReduceOp::kSum);
    check(out == testing::reference_reduce(DataType::kFloat32, ReduceOp::kSum, n, block,
                                           block * static_cast<std::size_t>(r)),
          "reduce_scatter block=" + std::to_string(block), r);

    testing::Buffer mine = testing::make_input(DataType::kInt32, ReduceOp::kSum, r, block);
    testing::Buffer gathered(total * 4);
    ctx.allgather(mine.data(), gathered.data(), block, DataType::kInt32);
    for (int src = 0; src < n; ++src) {
      testing::Buffer want = testing::make_input(DataType::kInt32, ReduceOp::kSum, src, block);
      // memcmp of zero bytes still needs valid pointers, and an empty vector has none.
      check(want.empty() || std::memcmp(gathered.data() + static_cast<std::size_t>(src) * block * 4,
                                        want.data(), want.size()) == 0,
            "allgather block=" + std::to_string(block), r);
    }
    for (int root = 0; root < n; ++root) {
      testing::Buffer want = testing::make_input(DataType::kFloat64, ReduceOp::kSum, root, block);
      testing::Buffer buf = r == root ? want : testing::Buffer(want.size(), 0);
      ctx.broadcast(buf.data(), block, DataType::kFloat64, root);
      check(buf == want, "broadcast root=" + std::to_string(root), r);
      testing::Buffer red(block * 8);
      testing::Buffer in64 = testing::make_input(DataType::kFloat64, ReduceOp::kMax, r, block);
      ctx.reduce(in64.data(), red.data(), block, DataType::kFloat64, ReduceOp::kMax, root);
      if (r == root) {
        check(red == testing::reference_reduce(DataType::kFloat64, ReduceOp::kMax, n, block),
              "reduce root=" + std::to_string(root), r);
      }
    }
  }
  std::vector<std::size_t> vcounts(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i)
    vcounts[static_cast<std::size_t>(i)] = static_cast<std::size_t>(i % 2 ? 0 : 1000 + i);
  const std::size_t vtotal = std::accumulate(vcounts.begin(), vcounts.end(), std::size_t{0});
  testing::Buffer vin = testing::make_input(DataType::kUInt8, ReduceOp::kSum, r,
                                            vcounts[static_cast<std::size_t>(r)]);
  testing::Buffer vout(vtotal);
  ctx.allgatherv(vin.data(), vout.data(), vcounts, DataType::kUInt8);
  std::size_t off = 0;
  for (int src = 0; src < n; ++src) {
    testing::Buffer want = testing::make_input(DataType::kUInt8, ReduceOp::kSum, src,
                                               vcounts[static_cast<std::size_t>(src)]);
    check(want.empty() || std::memcmp(vout.data() + off, want.data(), want.size()) == 0,
          "allgatherv", r);
    off += want.size();
  }
  run_block_and_p2p_checks(ctx);
  ctx.barrier();
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "check";
  try {
    auto ctx = init();
    if (mode == "check") {
      if (ctx->rank() == 0) std::printf("topology: %s\n", ctx->topology().c_str());
      run_checks(*ctx);
      std::printf("rank %d: %s, transport to rank %d: %s\n", ctx->rank(),
                  failures ? "FAILED" : "all checks passed", (ctx->rank() + 1) % ctx->size(),
                  ctx->transport_name((ctx->rank() + 1) % ctx->size()).c_str());
      return failures ? 1 : 0;
    }
    if (mode == "loop") {  // all-reduce until a peer dies; report how long detection took
      std::vector<float> buf(1 << 22, 1.0f);
      std::printf("rank %d: looping\n", ctx->rank());
      std::fflush(stdout);
      auto last_ok = std::chrono::steady_clock::now();
      try {
        for (;;) {
          ctx->allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kMax);
          last_ok = std::chrono::steady_clock::now();
        }
      } catch (const Error& e) {
        auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::steady_clock::now() - last_ok)
                      .count();
        std::fprintf(stderr, "rank %d: detected after %lld ms: %s\n", ctx->rank(),
                     static_cast<long long>(ms), e.what());
        return 4;
      }
    }
    std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 3;
  }
}
