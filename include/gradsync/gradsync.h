// gradsync public API: create a Context with init(), then run collectives on it.
//
//   auto ctx = gradsync::init();                    // reads RANK/WORLD_SIZE/... from the env
//   ctx->allreduce(grad.data(), grad.data(), grad.size(),
//                  gradsync::DataType::kFloat32, gradsync::ReduceOp::kAvg);
//
// Threading contract: a Context may be used from one thread at a time for issuing calls
// (like an NCCL communicator). Async calls run in issue order on the context's worker; a
// blocking call waits for earlier async calls first, so every rank sees the same order.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gradsync/error.h"
#include "gradsync/store.h"
#include "gradsync/types.h"

namespace gradsync {

// Explicit options override the environment (which follows torchrun, mpirun, PMI and srun).
// A field left at its default is taken from the environment, then from the default.
struct Options {
  int rank = -1;              // RANK | OMPI_COMM_WORLD_RANK | PMI_RANK | SLURM_PROCID
  int world_size = -1;        // WORLD_SIZE | OMPI_COMM_WORLD_SIZE | PMI_SIZE | SLURM_NTASKS
  int local_rank = -1;        // LOCAL_RANK | OMPI_COMM_WORLD_LOCAL_RANK | SLURM_LOCALID
  int local_world_size = -1;  // LOCAL_WORLD_SIZE | OMPI_COMM_WORLD_LOCAL_SIZE
  std::string master_addr;    // MASTER_ADDR (default 127.0.0.1)
  int master_port = -1;       // MASTER_PORT (default 29500)
  std::string token;          // GRADSYNC_TOKEN: per-job secret every connection must present
  std::string transport;  // GRADSYNC_TRANSPORT: "" (auto: shm same host, tcp otherwise) | shm | tcp
  Algorithm algorithm = Algorithm::kAuto;  // GRADSYNC_ALGO
  std::chrono::milliseconds timeout{0};    // GRADSYNC_TIMEOUT in ms (default 300000)
  std::shared_ptr<Store> store;  // rendezvous store; default: TCP store at master_addr:port
  // GRADSYNC_TOPOLOGY: groups of ranks the ring should keep together, for what host detection
  // cannot see (racks, hosts behind one switch): "0,2;1,3" (groups by ';', ranks by ','; every
  // rank once; the same on every rank). Default: the ranks of each host.
  std::string topology;
};

// Handle of an async collective. wait() rethrows the collective's error, if any.
class Work {
 public:
  Work() = default;
  struct State;
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}
  void wait();  // blocks until done (bounded by the context timeout)
  bool test();  // true once done (then wait() returns or throws at once)

 private:
  std::shared_ptr<State> state_;
};

class Context {
 public:
  struct Impl;
  explicit Context(std::unique_ptr<Impl> impl);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int rank() const;
  int size() const;
  int local_rank() const;
  int local_size() const;
  std::string transport_name(int peer) const;  // "shm", "tcp", "inproc", "self"

  // `send` may equal `recv` (in place). Counts are in elements of `dtype`.
  void allreduce(const void* send, void* recv, std::size_t count, DataType dtype, ReduceOp op,
                 Algorithm algo = Algorithm::kAuto);
  // `send` holds size() * recv_count elements; rank r receives block r reduced.
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DataType dtype,
                      ReduceOp op);
  // `recv` receives size() * send_count elements, rank r's block at offset r * send_count.
  void allgather(const void* send, void* recv, std::size_t send_count, DataType dtype);
  // Rank r contributes recv_counts[r] elements; blocks are packed in rank order into recv.
  void allgatherv(const void* send, void* recv, std::span<const std::size_t> recv_counts,
                  DataType dtype);
  void broadcast(void* data, std::size_t count, DataType dtype, int root);
  // Only `root` needs a `recv` buffer; other ranks may pass nullptr.
  void reduce(const void* send, void* recv, std::size_t count, DataType dtype, ReduceOp op,
              int root);
  void barrier();

  Work allreduce_async(const void* send, void* recv, std::size_t count, DataType dtype, ReduceOp op,
                       Algorithm algo = Algorithm::kAuto);
  Work reduce_scatter_async(const void* send, void* recv, std::size_t recv_count, DataType dtype,
                            ReduceOp op);
  Work allgather_async(const void* send, void* recv, std::size_t send_count, DataType dtype);
  Work broadcast_async(void* data, std::size_t count, DataType dtype, int root);

  // The algorithm kAuto would use for an all-reduce of `bytes` (from the cost model).
  Algorithm choose_allreduce_algorithm(std::size_t bytes) const;
  // The cost model's constants, in the form GRADSYNC_COST_MODEL accepts
  // ("alpha_us=0.4,bandwidth_gbps=18,..."): measured at start-up unless configured. The
  // algorithms it picks decide how float32 sums round, so a run that must repeat another
  // bit for bit (a resumed one) sets GRADSYNC_COST_MODEL to the other's.
  std::string cost_model() const;
  // Which ranks share a host, as init() found them (or GRADSYNC_TOPOLOGY set them):
  // "2 hosts: [0 2] [1 3]". Ring algorithms visit each host's ranks in a row.
  std::string topology() const;
  int hosts() const;            // hosts (or GRADSYNC_TOPOLOGY groups) the ranks span
  int host_of(int rank) const;  // 0..hosts()-1, hosts numbered by their lowest rank

  PeerTraffic traffic(int peer) const;
  PeerTraffic total_traffic() const;  // summed over peers

  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// Builds a context from `options` and the environment; blocks until every rank has joined
// (bounded by the timeout).
std::unique_ptr<Context> init(const Options& options = {});

}  // namespace gradsync
