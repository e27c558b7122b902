/* The C API from a C program of another project: every rank all-reduces (rank + 1) * (i + 1)
 * and checks the sum against n(n + 1)/2 * (i + 1), as allreduce_check.cc does in C++. Run it
 * under gradsync-run. */
#include <gradsync/gradsync_c.h>
#include <stdio.h>

int main(void) {
  gradsync_comm* comm = NULL;
  if (gradsync_init(NULL, &comm) != GRADSYNC_SUCCESS) {
    fprintf(stderr, "gradsync_init: %s\n", gradsync_last_error());
    return 1;
  }
  int rank = 0, n = 0;
  gradsync_comm_rank(comm, &rank);
  gradsync_comm_size(comm, &n);
  float data[1000];
  for (int i = 0; i < 1000; ++i) data[i] = (float)((rank + 1) * (i + 1));
  if (gradsync_allreduce(comm, data, data, 1000, GRADSYNC_FLOAT32, GRADSYNC_SUM) !=
      GRADSYNC_SUCCESS) {
    fprintf(stderr, "rank %d: %s\n", rank, gradsync_last_error());
    return 1;
  }
  for (int i = 0; i < 1000; ++i) {
    if (data[i] != (float)(n * (n + 1) / 2 * (i + 1))) {
      printf("rank %d: element %d is %g\n", rank, i, (double)data[i]);
      return 1;
    }
  }
  printf("rank %d of %d: C all-reduce correct, gradsync %s\n", rank, n, gradsync_version_string());
  return gradsync_finalize(comm) == GRADSYNC_SUCCESS ? 0 : 1;
}
