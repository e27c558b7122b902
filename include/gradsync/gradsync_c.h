// gradsync's C API: the stable ABI that bindings for other languages (Rust, Julia, Go, ...)
// link against, as NCCL's C API is. It is a thin layer over the C++ API of gradsync.h: the
// same communicator, the same calls and rules (order of calls across ranks, buffers of async
// calls, point-to-point matching); read gradsync.h for those.
//
// ABI rules: handles are opaque pointers; enums have fixed values that never change meaning
// (new values are appended); gradsync_options starts with its own size, so a program built
// against an older, shorter struct keeps working with a newer library; no function takes or
// returns a C++ type, and no C++ exception crosses this interface.
//
// Errors: every function returns a gradsync_result (GRADSYNC_SUCCESS, or the kind of error);
// gradsync_last_error() then gives the message of this thread's last failed call, naming
// the rank, the peer, the operation and the sizes as gradsync::Error does. After an error
// inside a collective the communicator is aborted on every rank and later calls fail at once
// with GRADSYNC_ERROR_ABORTED; gradsync_finalize() still frees it.
//
// Example:
//   gradsync_comm* comm = NULL;
//   gradsync_options options = GRADSYNC_OPTIONS_INIT;  // every field from the environment
//   if (gradsync_init(&options, &comm) != GRADSYNC_SUCCESS) {
//     fprintf(stderr, "gradsync: %s\n", gradsync_last_error());
//     return;
//   }
//   float grad[4] = {1, 2, 3, 4};
//   gradsync_allreduce(comm, grad, grad, 4, GRADSYNC_FLOAT32, GRADSYNC_AVG);
//   gradsync_finalize(comm);
#ifndef GRADSYNC_C_API_H
#define GRADSYNC_C_API_H

#include <stddef.h>
#include <stdint.h>

#include "gradsync/version.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum gradsync_result {
  GRADSYNC_SUCCESS = 0,
  GRADSYNC_ERROR_INVALID_ARGUMENT = 1,  // bad input from the caller (null buffer, bad root...)
  GRADSYNC_ERROR_MISMATCH = 2,          // ranks issued different calls (count, dtype, op...)
  GRADSYNC_ERROR_PEER_LOST = 3,         // a peer process died or its connection closed
  GRADSYNC_ERROR_TIMEOUT = 4,           // a wait passed its deadline
  GRADSYNC_ERROR_PROTOCOL = 5,          // a malformed, oversized or unauthenticated message
  GRADSYNC_ERROR_ABORTED = 6,           // the communicator was aborted after an error
  GRADSYNC_ERROR_SYSTEM = 7,            // an OS call failed (errno in the message)
  GRADSYNC_ERROR_INTERNAL = 8,          // anything else (out of memory): the message says what
} gradsync_result;

typedef enum gradsync_dtype {
  GRADSYNC_FLOAT32 = 0,
  GRADSYNC_FLOAT64 = 1,
  GRADSYNC_FLOAT16 = 2,
  GRADSYNC_BFLOAT16 = 3,
  GRADSYNC_INT32 = 4,
  GRADSYNC_INT64 = 5,
  GRADSYNC_UINT8 = 6,
  GRADSYNC_INT8 = 7,
  GRADSYNC_INT16 = 8,
  GRADSYNC_BOOL = 9,  // one byte, 0 or 1; reduces as logic
} gradsync_dtype;

// The bitwise ops take integer and bool dtypes only.
typedef enum gradsync_op {
  GRADSYNC_SUM = 0,
  GRADSYNC_AVG = 1,
  GRADSYNC_MIN = 2,
  GRADSYNC_MAX = 3,
  GRADSYNC_PROD = 4,
  GRADSYNC_BAND = 5,
  GRADSYNC_BOR = 6,
  GRADSYNC_BXOR = 7,
} gradsync_op;

// The all-reduce algorithm (gradsync::Algorithm).
typedef enum gradsync_algorithm {
  GRADSYNC_ALGORITHM_AUTO = 0,  // the cost model's choice per call
  GRADSYNC_ALGORITHM_RING = 1,
  GRADSYNC_ALGORITHM_RECURSIVE_DOUBLING = 2,
  GRADSYNC_ALGORITHM_HALVING_DOUBLING = 3,
  GRADSYNC_ALGORITHM_PARAMETER_SERVER = 4,
  GRADSYNC_ALGORITHM_SHARED_MEMORY = 5,
  GRADSYNC_ALGORITHM_HIERARCHICAL = 6,
} gradsync_algorithm;

// A communicator over every rank of the job (gradsync::Context), and the handle of an async
// call (gradsync::Work).
typedef struct gradsync_comm gradsync_comm;
typedef struct gradsync_work gradsync_work;

// What gradsync_init takes; a field left unset (-1, NULL, 0) comes from the environment as
// in gradsync::Options. Initialise it with GRADSYNC_OPTIONS_INIT, then set what you need.
typedef struct gradsync_options {
  size_t struct_size;       // sizeof(gradsync_options) where the caller was compiled
  int rank;                 // RANK, ...
  int size;                 // WORLD_SIZE, ...
  int local_rank;           // LOCAL_RANK, ...
  int local_size;           // LOCAL_WORLD_SIZE, ...
  const char* master_addr;  // MASTER_ADDR
  int master_port;          // MASTER_PORT
  const char* token;        // GRADSYNC_TOKEN: the job's secret
  const char* transport;    // GRADSYNC_TRANSPORT: "shm", "tcp", "ucx", "shm+ucx" or NULL (auto)
  gradsync_algorithm algorithm;  // GRADSYNC_ALGO
  int64_t timeout_ms;            // GRADSYNC_TIMEOUT; 0: the environment's (default 300000)
} gradsync_options;

#define GRADSYNC_OPTIONS_INIT \
  { sizeof(gradsync_options), -1, -1, -1, -1, NULL, -1, NULL, NULL, GRADSYNC_ALGORITHM_AUTO, 0 }

// "MAJOR.MINOR.PATCH" of the library linked in.
const char* gradsync_version_string(void);
// A constant name for `result` ("success", "invalid argument", "peer lost", ...).
const char* gradsync_result_string(gradsync_result result);
// The message of this thread's last call that failed ("" if none has); valid until this
// thread's next failing call.
const char* gradsync_last_error(void);

// Joins the job (blocks until every rank has, bounded by the timeout) and stores the new
// communicator in *comm. `options` may be NULL: everything from the environment.
gradsync_result gradsync_init(const gradsync_options* options, gradsync_comm** comm);
// Finishes every call still queued, then frees the communicator. NULL is accepted.
gradsync_result gradsync_finalize(gradsync_comm* comm);

gradsync_result gradsync_comm_rank(const gradsync_comm* comm, int* rank);
gradsync_result gradsync_comm_size(const gradsync_comm* comm, int* size);
gradsync_result gradsync_comm_local_rank(const gradsync_comm* comm, int* local_rank);
gradsync_result gradsync_comm_local_size(const gradsync_comm* comm, int* local_size);

// The collectives, blocking: each returns once this rank's part is done. Counts are in
// elements of `dtype`; `send` may equal `recv` (in place). The layouts are gradsync.h's:
// reduce_scatter's `send` holds size * recv_count elements; allgather's `recv` receives
// size * send_count; allgatherv's recv_counts and alltoallv's counts hold one entry a rank.
gradsync_result gradsync_allreduce(gradsync_comm* comm, const void* send, void* recv, size_t count,
                                   gradsync_dtype dtype, gradsync_op op);
gradsync_result gradsync_reduce_scatter(gradsync_comm* comm, const void* send, void* recv,
                                        size_t recv_count, gradsync_dtype dtype, gradsync_op op);
gradsync_result gradsync_allgather(gradsync_comm* comm, const void* send, void* recv,
                                   size_t send_count, gradsync_dtype dtype);
gradsync_result gradsync_allgatherv(gradsync_comm* comm, const void* send, void* recv,
                                    const size_t* recv_counts, gradsync_dtype dtype);
gradsync_result gradsync_broadcast(gradsync_comm* comm, void* data, size_t count,
                                   gradsync_dtype dtype, int root);
gradsync_result gradsync_reduce(gradsync_comm* comm, const void* send, void* recv, size_t count,
                                gradsync_dtype dtype, gradsync_op op, int root);
gradsync_result gradsync_barrier(gradsync_comm* comm);
gradsync_result gradsync_gather(gradsync_comm* comm, const void* send, void* recv, size_t count,
                                gradsync_dtype dtype, int root);
gradsync_result gradsync_scatter(gradsync_comm* comm, const void* send, void* recv, size_t count,
                                 gradsync_dtype dtype, int root);
gradsync_result gradsync_alltoall(gradsync_comm* comm, const void* send, void* recv, size_t count,
                                  gradsync_dtype dtype);
gradsync_result gradsync_alltoallv(gradsync_comm* comm, const void* send, const size_t* send_counts,
                                   void* recv, const size_t* recv_counts, gradsync_dtype dtype);
gradsync_result gradsync_send(gradsync_comm* comm, const void* data, size_t count,
                              gradsync_dtype dtype, int peer, int tag);
gradsync_result gradsync_recv(gradsync_comm* comm, void* data, size_t count, gradsync_dtype dtype,
                              int peer, int tag);

// The same calls, async: each queues the call and stores its handle in *work; the buffers
// stay in use until gradsync_work_wait returns or gradsync_work_test says done. The count
// arrays are copied and need not outlive the call. Free every handle with gradsync_work_free.
gradsync_result gradsync_allreduce_async(gradsync_comm* comm, const void* send, void* recv,
                                         size_t count, gradsync_dtype dtype, gradsync_op op,
                                         gradsync_work** work);
gradsync_result gradsync_reduce_scatter_async(gradsync_comm* comm, const void* send, void* recv,
                                              size_t recv_count, gradsync_dtype dtype,
                                              gradsync_op op, gradsync_work** work);
gradsync_result gradsync_allgather_async(gradsync_comm* comm, const void* send, void* recv,
                                         size_t send_count, gradsync_dtype dtype,
                                         gradsync_work** work);
gradsync_result gradsync_allgatherv_async(gradsync_comm* comm, const void* send, void* recv,
                                          const size_t* recv_counts, gradsync_dtype dtype,
                                          gradsync_work** work);
gradsync_result gradsync_broadcast_async(gradsync_comm* comm, void* data, size_t count,
                                         gradsync_dtype dtype, int root, gradsync_work** work);
gradsync_result gradsync_reduce_async(gradsync_comm* comm, const void* send, void* recv,
                                      size_t count, gradsync_dtype dtype, gradsync_op op, int root,
                                      gradsync_work** work);
gradsync_result gradsync_barrier_async(gradsync_comm* comm, gradsync_work** work);
gradsync_result gradsync_gather_async(gradsync_comm* comm, const void* send, void* recv,
                                      size_t count, gradsync_dtype dtype, int root,
                                      gradsync_work** work);
gradsync_result gradsync_scatter_async(gradsync_comm* comm, const void* send, void* recv,
                                       size_t count, gradsync_dtype dtype, int root,
                                       gradsync_work** work);
gradsync_result gradsync_alltoall_async(gradsync_comm* comm, const void* send, void* recv,
                                        size_t count, gradsync_dtype dtype, gradsync_work** work);
gradsync_result gradsync_alltoallv_async(gradsync_comm* comm, const void* send,
                                         const size_t* send_counts, void* recv,
                                         const size_t* recv_counts, gradsync_dtype dtype,
                                         gradsync_work** work);
gradsync_result gradsync_send_async(gradsync_comm* comm, const void* data, size_t count,
                                    gradsync_dtype dtype, int peer, int tag, gradsync_work** work);
gradsync_result gradsync_recv_async(gradsync_comm* comm, void* data, size_t count,
                                    gradsync_dtype dtype, int peer, int tag, gradsync_work** work);

// Blocks until the call is done and returns its result.
gradsync_result gradsync_work_wait(gradsync_work* work);
// Never blocks: *done is 1 once the call is done (its result is then returned), else 0 (and
// GRADSYNC_SUCCESS is returned).
gradsync_result gradsync_work_test(gradsync_work* work, int* done);
// Frees the handle (NULL is accepted). A call still running goes on, its buffers in use:
// wait for it first.
void gradsync_work_free(gradsync_work* work);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // GRADSYNC_C_API_H
