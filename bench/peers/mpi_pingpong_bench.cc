// Peer baseline: an MPI_Send/MPI_Recv round trip between ranks 0 and 1 (the OSU latency
// benchmark's loop) over the size sweep and timing rule of `gradsync-bench pingpong`, so that
// BENCHMARKS.md can put Open MPI's point-to-point latency beside ours.
//   mpirun --allow-run-as-root -np 2 --mca btl self,vader mpi_pingpong_bench --min-bytes 8

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "mpi_job.h"
#include "sweep.h"

namespace {

constexpr const char* kUsage =
    "usage: mpi_pingpong_bench [options]   (run under mpirun with 2 ranks or more; rank 0\n"
    "sends each size to rank 1, which sends it back; time(us) is half the round trip)\n";

}  // namespace

int main(int argc, char** argv) {
  peers::Sweep s;
  s.label = "mpi";
  s.min_bytes = 8;
  const std::string usage = std::string(kUsage) + peers::kSweepUsage;
  const peers::MpiJob job = peers::start_mpi(argc, argv, s, "mpi_pingpong_bench", usage);
  if (job.help_printed) return 0;
  const int rank = job.rank, n = job.ranks;
  if (n < 2) peers::usage_error("mpi_pingpong_bench", "needs 2 ranks or more", usage.c_str());

  // Rank 0 sends the sweep's exact inputs; rank 1 echoes what it received, so --check
  // compares the round trip's result with what was sent, byte for byte.
  gradsync::tools::PlacedBuffer<unsigned char> send(s.max_bytes, s.offset),
      recv(s.max_bytes, s.offset);
  for (std::size_t i = 0; i < send.size(); ++i) {
    send[i] = static_cast<unsigned char>(peers::input_value(0, i));
  }
  if (rank == 0) {
    std::printf("# mpi_pingpong_bench: %d ranks, ranks 0 and 1 ping-pong, iters %d, warmup %d%s\n",
                n, s.iters, s.warmup, s.check ? ", check" : "");
    std::printf("# time: half the mean round trip over the timed loop, max over ranks\n#\n");
    std::printf("# %12s %10s %11s %7s\n", "size(B)", "time(us)", "GB/s", "#wrong");
  }

  auto round_trip = [&](int bytes) {
    if (rank == 0) {
      peers::die_on("mpi_pingpong_bench",
                    MPI_Send(send.data(), bytes, MPI_BYTE, 1, 0, MPI_COMM_WORLD), "MPI_Send");
      peers::die_on("mpi_pingpong_bench",
                    MPI_Recv(recv.data(), bytes, MPI_BYTE, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE),
                    "MPI_Recv");
    } else if (rank == 1) {
      peers::die_on("mpi_pingpong_bench",
                    MPI_Recv(recv.data(), bytes, MPI_BYTE, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE),
                    "MPI_Recv");
      peers::die_on("mpi_pingpong_bench",
                    MPI_Send(recv.data(), bytes, MPI_BYTE, 0, 0, MPI_COMM_WORLD), "MPI_Send");
    }
  };

  std::vector<peers::Record> recs;
  std::uint64_t wrong_total = 0;
  for (std::size_t size : peers::sizes(s)) {
    const int bytes = static_cast<int>(size);  // MPI counts are int
    for (int k = 0; k < s.warmup; ++k) round_trip(bytes);
    std::fill(recv.data(), recv.data() + bytes, 0xff);
    MPI_Barrier(MPI_COMM_WORLD);  // outside the timed loop: ranks start it together
    const double t0 = MPI_Wtime();
    for (int k = 0; k < s.iters; ++k) round_trip(bytes);
    double one_way = (MPI_Wtime() - t0) / s.iters / 2;
    MPI_Allreduce(MPI_IN_PLACE, &one_way, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    unsigned long long wrong = 0;
    if (s.check && rank <= 1) {
      for (int i = 0; i < bytes; ++i)
        wrong += recv[static_cast<std::size_t>(i)] != send[static_cast<std::size_t>(i)];
    }
    MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_UNSIGNED_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    wrong_total += wrong;
    peers::Record r;
    r.bytes = r.count = size;
    r.time_us = one_way * 1e6;
    r.algbw_gbps = r.busbw_gbps = one_way > 0 ? static_cast<double>(size) / one_way / 1e9 : 0;
    r.wrong = wrong;
    recs.push_back(r);
    if (rank == 0) {
      std::printf("  %12zu %10.2f %11.3f %7s\n", size, r.time_us, r.algbw_gbps,
                  s.check ? std::to_string(wrong).c_str() : "n/a");
      std::fflush(stdout);
    }
  }
  if (rank == 0 && !s.json.empty()) {
    const char* pml = std::getenv("OMPI_MCA_pml");
    const char* btl = std::getenv("OMPI_MCA_btl");
    const std::string transport = pml && *pml   ? std::string("pml ") + pml
                                  : btl && *btl ? std::string("btl ") + btl
                                                : "default";
    peers::write_json(s, recs, "blocking", transport, n, "pingpong", "uint8");
  }
  MPI_Finalize();
  return wrong_total ? 1 : 0;
}
