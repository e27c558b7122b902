// Peer baseline: MPI_Allreduce (float32, sum) over the size sweep and timing rule of
// gradsync-bench, so BENCHMARKS.md can put Open MPI's numbers beside ours.
//   mpirun --allow-run-as-root --oversubscribe -np 4 --mca btl self,vader mpi_allreduce_bench

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "mpi_job.h"
#include "sweep.h"

namespace {

constexpr const char* kUsage =
    "usage: mpi_allreduce_bench [options]   (run under mpirun; --mca btl/coll_tuned_* choose\n"
    "the transport and algorithm and are echoed in the output)\n";

// mpirun passes --mca settings to the ranks as OMPI_MCA_* variables; reading them back makes
// the output say which byte transport and all-reduce algorithm were measured.
std::string mca(const char* name, const char* fallback) {
  const char* v = std::getenv((std::string("OMPI_MCA_") + name).c_str());
  return v && *v ? v : fallback;
}

// Open MPI 4.1's coll_tuned_allreduce_algorithm numbers (ompi_info --param coll tuned).
std::string tuned_algorithm() {
  const std::string id = mca("coll_tuned_allreduce_algorithm", "");
  const char* names[] = {"default", "basic_linear",   "nonoverlapping", "recursive_doubling",
                         "ring",    "segmented_ring", "rabenseifner"};
  if (id.empty() || mca("coll_tuned_use_dynamic_rules", "0") == "0") return "default";
  int k = std::atoi(id.c_str());
  return k >= 0 && k < 7 ? names[k] : "tuned-" + id;
}

}  // namespace

int main(int argc, char** argv) {
  peers::Sweep s;
  s.label = "mpi";
  const std::string usage = std::string(kUsage) + peers::kSweepUsage;
  const peers::MpiJob job = peers::start_mpi(argc, argv, s, "mpi_allreduce_bench", usage);
  if (job.help_printed) return 0;
  const int rank = job.rank, n = job.ranks;

  const std::size_t max_count = s.max_bytes / sizeof(float);
  // Out of place, like gradsync-bench's allreduce: the input stays valid for every call.
  gradsync::tools::PlacedBuffer<float> send(max_count, s.offset), recv(max_count, s.offset);
  peers::fill_input(send.data(), max_count, rank);

  int version_len = 0;
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  MPI_Get_library_version(version, &version_len);
  std::string lib(version);
  lib = lib.substr(0, lib.find_first_of(",\n"));
  const std::string btl = mca("btl", "default btl"), algo = tuned_algorithm();
  if (rank == 0) {
    peers::print_header("mpi_allreduce_bench", s, n, lib + ", btl " + btl + ", algo " + algo);
  }

  std::vector<peers::Record> recs;
  std::uint64_t wrong_total = 0;
  for (std::size_t bytes : peers::sizes(s)) {
    const int count = static_cast<int>(bytes / sizeof(float));  // MPI counts are int
    for (int k = 0; k < s.warmup; ++k) {
      peers::die_on(
          "mpi_allreduce_bench",
          MPI_Allreduce(send.data(), recv.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
          "MPI_Allreduce");
    }
    if (s.check) std::fill(recv.data(), recv.data() + count, -1.0f);
    MPI_Barrier(MPI_COMM_WORLD);  // outside the timed loop: ranks start it together
    double t0 = MPI_Wtime();
    for (int k = 0; k < s.iters; ++k) {
      peers::die_on(
          "mpi_allreduce_bench",
          MPI_Allreduce(send.data(), recv.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
          "MPI_Allreduce");
    }
    double per_call = (MPI_Wtime() - t0) / s.iters;
    // The slowest rank defines the collective's time.
    MPI_Allreduce(MPI_IN_PLACE, &per_call, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    unsigned long long wrong =
        s.check ? peers::count_wrong_sum(recv.data(), static_cast<std::size_t>(count), n) : 0;
    MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_UNSIGNED_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    wrong_total += wrong;
    recs.push_back(peers::make_record(static_cast<std::size_t>(count), per_call, n, wrong));
    if (rank == 0) peers::print_row(s, recs.back());
  }
  if (rank == 0 && !s.json.empty()) peers::write_json(s, recs, algo, btl, n);
  MPI_Finalize();
  return wrong_total ? 1 : 0;
}
