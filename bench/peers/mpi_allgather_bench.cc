// Peer baseline: MPI_Allgather (float32) over the size sweep and timing rule of gradsync-bench
// allgather, whose size is the whole output (ranks x block), as in nccl-tests.
//   mpirun --allow-run-as-root --oversubscribe -np 4 --mca btl self,vader mpi_allgather_bench

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "mpi_job.h"
#include "sweep.h"

int main(int argc, char** argv) {
  peers::Sweep s;
  s.label = "mpi";
  const std::string usage =
      std::string("usage: mpi_allgather_bench [options]   (run under mpirun)\n") +
      peers::kSweepUsage;
  const peers::MpiJob job = peers::start_mpi(argc, argv, s, "mpi_allgather_bench", usage);
  if (job.help_printed) return 0;
  const int rank = job.rank, n = job.ranks;
  const auto ranks = static_cast<std::size_t>(n);

  const std::size_t max_block = s.max_bytes / sizeof(float) / ranks;
  gradsync::tools::PlacedBuffer<float> send(max_block, s.offset), recv(max_block * ranks, s.offset);
  peers::fill_input(send.data(), max_block, rank);

  const char* btl_env = std::getenv("OMPI_MCA_btl");
  const char* algo_env = std::getenv("OMPI_MCA_coll_tuned_allgather_algorithm");
  const std::string btl = btl_env && *btl_env ? btl_env : "default btl";
  const std::string algo = algo_env && *algo_env ? std::string("tuned-") + algo_env : "default";
  if (rank == 0) {
    peers::print_header("mpi_allgather_bench", s, n, "btl " + btl + ", algo " + algo, "-");
  }

  std::uint64_t wrong_total = 0;
  std::vector<peers::Record> recs;
  for (std::size_t bytes : peers::sizes(s)) {
    const std::size_t block = bytes / sizeof(float) / ranks;
    const int count = static_cast<int>(block);  // MPI counts are int
    auto gather = [&] {
      peers::die_on("mpi_allgather_bench",
                    MPI_Allgather(send.data(), count, MPI_FLOAT, recv.data(), count, MPI_FLOAT,
                                  MPI_COMM_WORLD),
                    "MPI_Allgather");
    };
    for (int k = 0; k < s.warmup; ++k) gather();
    if (s.check) std::fill(recv.data(), recv.data() + block * ranks, -1.0f);
    MPI_Barrier(MPI_COMM_WORLD);  // outside the timed loop: ranks start it together
    double t0 = MPI_Wtime();
    for (int k = 0; k < s.iters; ++k) gather();
    double per_call = (MPI_Wtime() - t0) / s.iters;
    // The slowest rank defines the collective's time.
    MPI_Allreduce(MPI_IN_PLACE, &per_call, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    unsigned long long wrong = 0;
    if (s.check) {
      for (int src = 0; src < n; ++src) {
        const float* got = recv.data() + static_cast<std::size_t>(src) * block;
        for (std::size_t i = 0; i < block; ++i) wrong += got[i] != peers::input_value(src, i);
      }
    }
    MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_UNSIGNED_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    wrong_total += wrong;
    recs.push_back(peers::make_record(block * ranks, per_call, n, wrong, 1.0));
    if (rank == 0) peers::print_row(s, recs.back());
  }
  if (rank == 0 && !s.json.empty()) peers::write_json(s, recs, algo, btl, n, "allgather");
  MPI_Finalize();
  return wrong_total ? 1 : 0;
}
