/* A rank of the C API's tests, written in C11 so that gradsync_c.h is compiled as C: started by
 * gradsync-run, it joins through the environment and, in mode "check", runs every collective
 * (blocking and async) over a grid of dtypes, ops and counts against a reference each rank
 * computes itself; in mode "mismatch", rank 0 all-reduces one element more than the others, and
 * every rank must fail with a message naming the mismatch (GRADSYNC_ERROR_MISMATCH where it is
 * seen, GRADSYNC_ERROR_ABORTED on the ranks it aborts). Exit code 0: every check passed.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gradsync/gradsync_c.h"

static int failures = 0;
static int my_rank = -1;

static void check(int ok, const char* what, const char* detail) {
  if (!ok) {
    ++failures;
    fprintf(stderr, "rank %d: FAILED %s (%s)\n", my_rank, what, detail);
  }
}

static void check_result(gradsync_result r, const char* what) {
  check(r == GRADSYNC_SUCCESS, what, r == GRADSYNC_SUCCESS ? "" : gradsync_last_error());
}

/* Every rank can compute every other rank's data: element i of rank r. Small integers, so
 * sums and products are exact in every dtype tested. */
static double value(int r, size_t i, gradsync_op op) {
  if (op == GRADSYNC_PROD) return (double)(1 + (r + (int)i) % 2);
  return (double)(((r + 1) * 7 + (int)(i % 1000) * 3) % 11 + 1);
}

static size_t dtype_size(gradsync_dtype t) {
  switch (t) {
    case GRADSYNC_FLOAT64:
    case GRADSYNC_INT64:
      return 8;
    default:
      return 4;
  }
}

static void store(gradsync_dtype t, void* base, size_t i, double v) {
  switch (t) {
    case GRADSYNC_FLOAT32:
      ((float*)base)[i] = (float)v;
      break;
    case GRADSYNC_FLOAT64:
      ((double*)base)[i] = v;
      break;
    case GRADSYNC_INT32:
      ((int32_t*)base)[i] = (int32_t)v;
      break;
    case GRADSYNC_INT64:
      ((int64_t*)base)[i] = (int64_t)v;
      break;
    default:
      abort();
  }
}

static double load(gradsync_dtype t, const void* base, size_t i) {
  switch (t) {
    case GRADSYNC_FLOAT32:
      return ((const float*)base)[i];
    case GRADSYNC_FLOAT64:
      return ((const double*)base)[i];
    case GRADSYNC_INT32:
      return ((const int32_t*)base)[i];
    case GRADSYNC_INT64:
      return (double)((const int64_t*)base)[i];
    default:
      abort();
  }
}

static double reduced(int n, size_t i, gradsync_op op) {
  double acc = value(0, i, op);
  for (int r = 1; r < n; ++r) {
    const double v = value(r, i, op);
    switch (op) {
      case GRADSYNC_SUM:
      case GRADSYNC_AVG:
        acc += v;
        break;
      case GRADSYNC_MIN:
        acc = v < acc ? v : acc;
        break;
      case GRADSYNC_MAX:
        acc = v > acc ? v : acc;
        break;
      case GRADSYNC_PROD:
        acc *= v;
        break;
      case GRADSYNC_BAND:
        acc = (double)((int64_t)acc & (int64_t)v);
        break;
      case GRADSYNC_BOR:
        acc = (double)((int64_t)acc | (int64_t)v);
        break;
      case GRADSYNC_BXOR:
        acc = (double)((int64_t)acc ^ (int64_t)v);
        break;
    }
  }
  return op == GRADSYNC_AVG ? acc / n : acc;
}

static int near(double got, double want) {
  return fabs(got - want) <= 1e-5 * fabs(want) + 1e-6;
}

/* `count` elements of rank r's data, from element `first` on. */
static void* filled(gradsync_dtype t, int r, size_t first, size_t count, gradsync_op op) {
  void* p = malloc(dtype_size(t) * (count ? count : 1));
  for (size_t i = 0; i < count; ++i) store(t, p, i, value(r, first + i, op));
  return p;
}

static void check_reductions(gradsync_comm* comm, int n, int r) {
  const gradsync_dtype dtypes[] = {GRADSYNC_FLOAT32, GRADSYNC_FLOAT64, GRADSYNC_INT32,
                                   GRADSYNC_INT64};
  const size_t counts[] = {0, 1, 7, 4099};
  char what[160];
  for (size_t d = 0; d < sizeof dtypes / sizeof *dtypes; ++d) {
    const gradsync_dtype t = dtypes[d];
    const int floating = t == GRADSYNC_FLOAT32 || t == GRADSYNC_FLOAT64;
    for (int op = GRADSYNC_SUM; op <= GRADSYNC_BXOR; ++op) {
      if (floating ? op > GRADSYNC_PROD : op == GRADSYNC_AVG) continue;
      for (size_t c = 0; c < sizeof counts / sizeof *counts; ++c) {
        const size_t count = counts[c];
        snprintf(what, sizeof what, "dtype %d op %d count %zu", (int)t, op, count);
        /* allreduce, blocking out of place, then async in place */
        void* send = filled(t, r, 0, count, (gradsync_op)op);
        void* recv = malloc(dtype_size(t) * (count ? count : 1));
        check_result(gradsync_allreduce(comm, send, recv, count, t, (gradsync_op)op), what);
        for (size_t i = 0; i < count; ++i) {
          check(near(load(t, recv, i), reduced(n, i, (gradsync_op)op)), "allreduce", what);
        }
        gradsync_work* work = NULL;
        check_result(gradsync_allreduce_async(comm, send, send, count, t, (gradsync_op)op, &work),
                     what);
        check_result(gradsync_work_wait(work), what);
        gradsync_work_free(work);
        check(count == 0 || memcmp(send, recv, dtype_size(t) * count) == 0, "allreduce_async",
              what);
        free(send);
        free(recv);

        /* reduce_scatter: block r of the reduced whole */
        void* whole = filled(t, r, 0, count * (size_t)n, (gradsync_op)op);
        void* block = malloc(dtype_size(t) * (count ? count : 1));
        check_result(gradsync_reduce_scatter(comm, whole, block, count, t, (gradsync_op)op), what);
        for (size_t i = 0; i < count; ++i) {
          check(near(load(t, block, i), reduced(n, (size_t)r * count + i, (gradsync_op)op)),
                "reduce_scatter", what);
        }
        free(whole);
        free(block);

        /* reduce to the last rank, async */
        send = filled(t, r, 0, count, (gradsync_op)op);
        recv = r == n - 1 ? malloc(dtype_size(t) * (count ? count : 1)) : NULL;
        check_result(
            gradsync_reduce_async(comm, send, recv, count, t, (gradsync_op)op, n - 1, &work), what);
        check_result(gradsync_work_wait(work), what);
        gradsync_work_free(work);
        for (size_t i = 0; recv && i < count; ++i) {
          check(near(load(t, recv, i), reduced(n, i, (gradsync_op)op)), "reduce", what);
        }
        free(send);
        free(recv);
      }
    }
  }
}

/* The collectives that move blocks: each block's content names its source rank. */
static void check_movement(gradsync_comm* comm, int n, int r) {
  const size_t counts[] = {0, 1, 7, 70001};
  const gradsync_dtype t = GRADSYNC_INT32;
  char what[80];
  for (size_t c = 0; c < sizeof counts / sizeof *counts; ++c) {
    const size_t count = counts[c], total = count * (size_t)n;
    snprintf(what, sizeof what, "count %zu", count);
    int32_t* mine = filled(t, r, 0, count, GRADSYNC_SUM);
    int32_t* all = malloc(sizeof(int32_t) * (total ? total : 1));

    check_result(gradsync_allgather(comm, mine, all, count, t), what);
    for (int src = 0; src < n; ++src) {
      for (size_t i = 0; i < count; ++i) {
        check(all[(size_t)src * count + i] == (int32_t)value(src, i, GRADSYNC_SUM), "allgather",
              what);
      }
    }

    /* allgatherv: rank k contributes (k % 3) * count elements */
    size_t* sizes = malloc(sizeof(size_t) * (size_t)n);
    size_t sum = 0;
    for (int k = 0; k < n; ++k) sum += sizes[k] = (size_t)(k % 3) * count;
    int32_t* packed = malloc(sizeof(int32_t) * (sum ? sum : 1));
    int32_t* part = filled(t, r, 0, sizes[r], GRADSYNC_SUM);
    gradsync_work* work = NULL;
    check_result(gradsync_allgatherv_async(comm, part, packed, sizes, t, &work), what);
    check_result(gradsync_work_wait(work), what);
    gradsync_work_free(work);
    for (int src = 0, at = 0; src < n; at += (int)sizes[src], ++src) {
      for (size_t i = 0; i < sizes[src]; ++i) {
        check(packed[(size_t)at + i] == (int32_t)value(src, i, GRADSYNC_SUM), "allgatherv", what);
      }
    }
    free(part);
    free(packed);

    for (int root = 0; root<n; root += n - 1> 0 ? n - 1 : 1) {
      int32_t* data = filled(t, r == root ? root : -1, 0, count, GRADSYNC_SUM);
      check_result(gradsync_broadcast(comm, data, count, t, root), what);
      for (size_t i = 0; i < count; ++i) {
        check(data[i] == (int32_t)value(root, i, GRADSYNC_SUM), "broadcast", what);
      }
      free(data);

      check_result(gradsync_gather(comm, mine, r == root ? all : NULL, count, t, root), what);
      for (int src = 0; r == root && src < n; ++src) {
        for (size_t i = 0; i < count; ++i) {
          check(all[(size_t)src * count + i] == (int32_t)value(src, i, GRADSYNC_SUM), "gather",
                what);
        }
      }

      /* scatter: block k of root's data is rank k's data, as the allgather above left it */
      int32_t* got = malloc(sizeof(int32_t) * (count ? count : 1));
      check_result(gradsync_scatter_async(comm, r == root ? all : NULL, got, count, t, root, &work),
                   what);
      check_result(gradsync_work_wait(work), what);
      gradsync_work_free(work);
      for (size_t i = 0; i < count; ++i) {
        check(got[i] == (int32_t)value(r, i, GRADSYNC_SUM), "scatter", what);
      }
      free(got);
      if (n == 1) break;
    }

    /* alltoall: block j of rank i's send holds i * 1000 + j */
    int32_t* out = malloc(sizeof(int32_t) * (total ? total : 1));
    int32_t* in = malloc(sizeof(int32_t) * (total ? total : 1));
    for (int j = 0; j < n; ++j) {
      for (size_t i = 0; i < count; ++i) out[(size_t)j * count + i] = r * 1000 + j;
    }
    check_result(gradsync_alltoall(comm, out, in, count, t), what);
    for (int src = 0; src < n; ++src) {
      for (size_t i = 0; i < count; ++i) {
        check(in[(size_t)src * count + i] == src * 1000 + r, "alltoall", what);
      }
    }

    /* alltoallv: rank i sends rank j ((i + j) % 3) * count elements */
    size_t* send_counts = malloc(sizeof(size_t) * (size_t)n);
    size_t* recv_counts = malloc(sizeof(size_t) * (size_t)n);
    size_t send_total = 0, recv_total = 0;
    for (int j = 0; j < n; ++j) {
      send_total += send_counts[j] = (size_t)((r + j) % 3) * count;
      recv_total += recv_counts[j] = (size_t)((j + r) % 3) * count;
    }
    int32_t* vout = malloc(sizeof(int32_t) * (send_total ? send_total : 1));
    int32_t* vin = malloc(sizeof(int32_t) * (recv_total ? recv_total : 1));
    for (int j = 0, at = 0; j < n; at += (int)send_counts[j], ++j) {
      for (size_t i = 0; i < send_counts[j]; ++i) vout[(size_t)at + i] = r * 1000 + j;
    }
    check_result(gradsync_alltoallv_async(comm, vout, send_counts, vin, recv_counts, t, &work),
                 what);
    check_result(gradsync_work_wait(work), what);
    gradsync_work_free(work);
    for (int src = 0, at = 0; src < n; at += (int)recv_counts[src], ++src) {
      for (size_t i = 0; i < recv_counts[src]; ++i) {
        check(vin[(size_t)at + i] == src * 1000 + r, "alltoallv", what);
      }
    }
    free(vout);
    free(vin);
    free(send_counts);
    free(recv_counts);

    /* a ring of sends and recvs, both async, tagged with the count */
    if (n > 1) {
      const int next = (r + 1) % n, prev = (r + n - 1) % n;
      int32_t* ring_in = malloc(sizeof(int32_t) * (count ? count : 1));
      gradsync_work *sent = NULL, *received = NULL;
      check_result(gradsync_send_async(comm, mine, count, t, next, (int)count, &sent), what);
      check_result(gradsync_recv_async(comm, ring_in, count, t, prev, (int)count, &received), what);
      check_result(gradsync_work_wait(sent), what);
      int done = 0;
      while (!done) check_result(gradsync_work_test(received, &done), what);
      gradsync_work_free(sent);
      gradsync_work_free(received);
      for (size_t i = 0; i < count; ++i) {
        check(ring_in[i] == (int32_t)value(prev, i, GRADSYNC_SUM), "send/recv", what);
      }
      free(ring_in);
    }
    free(in);
    free(out);
    free(sizes);
    free(mine);
    free(all);
  }
  check_result(gradsync_barrier(comm), "barrier");
}

/* Refusals of what C cannot check at compile time; the last one (a root out of range) is the
 * C++ layer's, and it is the last call of the run. */
static void check_refusals(gradsync_comm* comm, int n) {
  float x = 1;
  gradsync_result r = gradsync_allreduce(NULL, &x, &x, 1, GRADSYNC_FLOAT32, GRADSYNC_SUM);
  check(r == GRADSYNC_ERROR_INVALID_ARGUMENT && strstr(gradsync_last_error(), "comm is NULL"),
        "a NULL comm is refused", gradsync_last_error());
  r = gradsync_allreduce(comm, &x, &x, 1, (gradsync_dtype)42, GRADSYNC_SUM);
  check(r == GRADSYNC_ERROR_INVALID_ARGUMENT &&
            strstr(gradsync_last_error(), "dtype 42 is not a gradsync_dtype"),
        "a dtype out of range is refused", gradsync_last_error());
  r = gradsync_allgatherv(comm, &x, &x, NULL, GRADSYNC_FLOAT32);
  check(r == GRADSYNC_ERROR_INVALID_ARGUMENT && strstr(gradsync_last_error(), "recv_counts"),
        "NULL counts are refused", gradsync_last_error());
  r = gradsync_broadcast(comm, &x, 1, GRADSYNC_FLOAT32, n);
  check(r == GRADSYNC_ERROR_INVALID_ARGUMENT && strstr(gradsync_last_error(), "root"),
        "a root out of range is refused", gradsync_last_error());
  check(strcmp(gradsync_result_string(GRADSYNC_ERROR_PEER_LOST), "peer lost") == 0,
        "result strings", gradsync_result_string(GRADSYNC_ERROR_PEER_LOST));
}

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "check";
  gradsync_options options = GRADSYNC_OPTIONS_INIT;
  options.timeout_ms = 60000;
  gradsync_comm* comm = NULL;
  if (gradsync_init(&options, &comm) != GRADSYNC_SUCCESS) {
    fprintf(stderr, "gradsync_init failed: %s\n", gradsync_last_error());
    return 2;
  }
  int n = 0;
  check_result(gradsync_comm_rank(comm, &my_rank), "comm_rank");
  check_result(gradsync_comm_size(comm, &n), "comm_size");
  if (strcmp(mode, "mismatch") == 0) {
    float data[2] = {1, 2};
    const gradsync_result r =
        gradsync_allreduce(comm, data, data, my_rank == 0 ? 2 : 1, GRADSYNC_FLOAT32, GRADSYNC_SUM);
    /* The rank that sees the mismatch fails with it, the others abort quoting it. */
    check((r == GRADSYNC_ERROR_MISMATCH || r == GRADSYNC_ERROR_ABORTED) &&
              strstr(gradsync_last_error(), "mismatched call in allreduce"),
          "a mismatched call fails on every rank", gradsync_last_error());
    printf("rank %d: refused (%s)\n", my_rank, gradsync_result_string(r));
  } else {
    check_reductions(comm, n, my_rank);
    check_movement(comm, n, my_rank);
    check_refusals(comm, n);
  }
  check_result(gradsync_finalize(comm), "finalize");
  if (failures == 0)
    printf("rank %d of %d: every C API check passed (gradsync %s)\n", my_rank, n,
           gradsync_version_string());
  return failures == 0 ? 0 : 1;
}
