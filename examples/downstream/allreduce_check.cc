// A program of another project: every rank all-reduces (rank + 1) * (i + 1) and checks the
// sum against n(n + 1)/2 * (i + 1); prints the library's version. Run it under gradsync-run.
#include <gradsync/gradsync.h>

#include <cstdio>
#include <vector>

int main() {
  auto ctx = gradsync::init();
  const int n = ctx->size();
  std::vector<float> data(1000);
  for (std::size_t i = 0; i < data.size(); ++i) {
    data[i] = static_cast<float>((ctx->rank() + 1) * (i + 1));
  }
  ctx->allreduce(data.data(), data.data(), data.size(), gradsync::DataType::kFloat32,
                 gradsync::ReduceOp::kSum);
  for (std::size_t i = 0; i < data.size(); ++i) {
    if (data[i] != static_cast<float>(n * (n + 1) / 2 * (i + 1))) {
      std::printf("rank %d: element %zu is %g\n", ctx->rank(), i, static_cast<double>(data[i]));
      return 1;
    }
  }
  std::printf("rank %d of %d: all-reduce correct, gradsync %s\n", ctx->rank(), n,
              gradsync::version());
  return 0;
}
