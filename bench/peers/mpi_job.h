// What the Open MPI peer benchmarks share: starting the job and reading the sweep's flags, and
// ending it on an MPI error, naming the call.
#pragma once

#include <mpi.h>

#include <cstdio>
#include <string>

#include "sweep.h"

namespace peers {

// Aborts every rank if `rc` is an error (the communicator returns errors: MPI_ERRORS_RETURN).
inline void die_on(const char* prog, int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  std::fprintf(stderr, "%s: %s failed: %s\n", prog, what, msg);
  MPI_Abort(MPI_COMM_WORLD, 1);
}

struct MpiJob {
  int rank = 0;
  int ranks = 1;
  bool help_printed = false;  // --help: the job is finalized, main returns 0
};

// MPI_Init, then the sweep flags into `s` (anything else is a usage error naming `prog`).
inline MpiJob start_mpi(int& argc, char**& argv, Sweep& s, const char* prog,
                        const std::string& usage) {
  MPI_Init(&argc, &argv);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MpiJob job;
  MPI_Comm_rank(MPI_COMM_WORLD, &job.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &job.ranks);
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "-h" || std::string(argv[i]) == "--help") {
      if (job.rank == 0) std::fputs(usage.c_str(), stdout);
      MPI_Finalize();
      job.help_printed = true;
      return job;
    }
    if (!parse_sweep_flag(argc, argv, i, s, prog, usage.c_str())) {
      usage_error(prog, std::string("unknown option '") + argv[i] + "'", usage.c_str());
    }
  }
  return job;
}

}  // namespace peers
