// gradsync public API: create a Context with init(), then run collectives on it.
//
// Example:
//   auto ctx = gradsync::init();                    // reads RANK/WORLD_SIZE/... from the env
//   ctx->allreduce(grad.data(), grad.data(), grad.size(),
//                  gradsync::DataType::kFloat32, gradsync::ReduceOp::kAvg);
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gradsync/error.h"
#include "gradsync/store.h"
#include "gradsync/types.h"
#include "gradsync/version.h"

namespace gradsync {

// Explicit options override the environment (which follows torchrun, mpirun, PMI and srun).
// A field left at its default is taken from the environment, then from the default. Every
// field has an initializer, so designated initializers may name just the fields they set:
// init({.rank = 0, .size = 1}). Every
// GRADSYNC_* variable, with its default, is in README's knob table; the ones without a field
// here are process-wide.
struct Options {
  int rank = -1;              // RANK | OMPI_COMM_WORLD_RANK | PMI_RANK | SLURM_PROCID
  int size = -1;              // WORLD_SIZE | OMPI_COMM_WORLD_SIZE | PMI_SIZE | SLURM_NTASKS
  int local_rank = -1;        // LOCAL_RANK | OMPI_COMM_WORLD_LOCAL_RANK | SLURM_LOCALID
  int local_size = -1;        // LOCAL_WORLD_SIZE | OMPI_COMM_WORLD_LOCAL_SIZE
  std::string master_addr{};  // MASTER_ADDR (default 127.0.0.1)
  int master_port = -1;       // MASTER_PORT (default 29500)
  std::string token{};        // GRADSYNC_TOKEN: per-job secret every connection must present
  // GRADSYNC_TRANSPORT: "" (auto: shm within a host, tcp across) | shm | tcp | ucx (every
  // peer through UCX) | shm+ucx (shm within a host, UCX across)
  std::string transport{};
  Algorithm algorithm = Algorithm::kAuto;  // GRADSYNC_ALGO
  std::chrono::milliseconds timeout{0};    // GRADSYNC_TIMEOUT in ms (default 300000)
  std::shared_ptr<Store> store{};  // rendezvous store; default: TCP store at master_addr:port
  // GRADSYNC_TOPOLOGY: groups of ranks the ring should keep together, for what host detection
  // cannot see (racks, hosts behind one switch): "0,2;1,3" (groups by ';', ranks by ','; every
  // rank once; the same on every rank). Default: the ranks of each host.
  std::string topology{};
  // GRADSYNC_COST_MODEL: the cost model's constants as Context::cost_model() prints them
  // ("alpha_us=0.4,bandwidth_gbps=18,..."), instead of measuring them at start-up. A run that
  // must repeat another bit for bit passes the other's: they decide the algorithms, and so
  // how float32 sums round.
  std::string cost_model{};
  // GRADSYNC_HOST_ID: ranks with the same id share memory. Default: this host's name, boot id
  // and network namespace.
  std::string host_id{};
  // GRADSYNC_SOCKET_IFNAME: the network interface whose address every socket of this rank
  // binds to and advertises (the store rank 0 hosts included), like NCCL_SOCKET_IFNAME.
  // Default: listen on every interface. Takes precedence over socket_addr.
  std::string socket_ifname{};
  // GRADSYNC_SOCKET_ADDR: the address the tcp transport advertises to peers. Default: this
  // host's address on the route to master_addr.
  std::string socket_addr{};
  // GRADSYNC_STORE_BIND: the address the store rank 0 hosts listens on ("0.0.0.0": every
  // interface). Default: socket_ifname's address, else master_addr where it is an address of
  // this host (so a store for 127.0.0.1 is not reachable from the network), else every
  // interface.
  std::string store_bind{};
  // GRADSYNC_TCP_LIVENESS_S: a peer whose host stops answering (no FIN or RST ever comes) is
  // declared lost after about this many seconds; 0: never (then only the timeout ends such a
  // wait). Default 15.
  int tcp_liveness_s = -1;
  // GRADSYNC_TCP_SOCKBUF_BYTES: SO_SNDBUF and SO_RCVBUF of every tcp connection. Default 0:
  // the kernel's autotuning, which may grow buffers past what an explicit size may.
  int tcp_socket_buffer_bytes = -1;
  // GRADSYNC_TCP_SPIN_US: how long a caller waiting on tcp polls its sockets before it sleeps
  // in poll(); 0: sleep at once. Default 50, or 100 yielding the core when ranks share cores.
  int tcp_spin_us = -1;
  // GRADSYNC_SHM_SPIN_US: how long an idle shared-memory waiter looks for progress before it
  // sleeps on its futex; 0: sleep at once. Default 20, or 100 yielding when ranks share cores.
  int shm_spin_us = -1;
};

// Per-call settings; a field left at its default takes the context's.
struct CallOptions {
  // All-reduce only: the algorithm (kAuto: the cost model's choice, or Options::algorithm).
  Algorithm algorithm = Algorithm::kAuto;
  // How long the call may take once it starts running (0: Options::timeout). Past it, the
  // call fails with kTimeout and the communicator is aborted on every rank.
  std::chrono::milliseconds timeout{0};
  // What the caller knows of the data beyond count and dtype, hashed (e.g. a tensor's shape):
  // compared across ranks like the count, so ranks whose calls carry different fingerprints
  // fail with kMismatch instead of silently combining differently shaped data. 0: none.
  std::uint32_t fingerprint = 0;
};

// Handle of an async call. Copies share the call.
class Work {
 public:
  Work() = default;  // an empty handle: done, no error
  struct State;
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}

  // Blocks until the call is done (its own deadline bounds the wait) and rethrows its error.
  // A call that is next in the context's queue while its worker is idle runs on the waiting
  // thread itself, sparing the hand-off to the worker and back.
  void wait();
  // As wait(), but gives up after `timeout`: false if the call is still running (it goes on;
  // its buffers stay in use). Leaves the call to the worker.
  bool wait(std::chrono::milliseconds timeout);
  // Runs the call on this thread, as wait() does, if it is next in its context's queue and the
  // worker is idle (only where the host has a core per rank); true if it ran it. For waiters
  // that complete elsewhere (torch's Work): the call's callbacks have run when it returns.
  bool run_if_next();
  // True once the call is done (then wait() returns or throws at once). Never blocks.
  bool test() const;
  // The call's error once it is done; null if it succeeded or is still running.
  std::exception_ptr error() const;
  // Waits, then: true if a compressed all-reduce under NonFinite::kSkip found NaN or Inf and
  // skipped the step on every rank. False for every other call.
  bool skipped();
  // Runs `callback` once the call is done: at once on this thread if it already is, else
  // on the thread that finishes it (the context's worker for an async call), right after
  // waiters are woken (the waiting thread, if wait() ran the call). For bindings that complete
  // their own futures (torch's). The callback
  // must not block on this context's later calls; it may issue async ones. An empty handle
  // runs it at once.
  void on_done(std::function<void()> callback);

 private:
  std::shared_ptr<State> state_;
};

namespace detail {
struct ContextAccess;
}

// A communicator over every rank of the job, as init() builds it.
//
// Calls: every collective comes blocking and async (`_async`, returning a Work). All of them
// run in the order they were issued, one at a time, on the context's worker thread (a blocking
// call waits for the calls before it, then runs; Work::wait may run the next call itself), so each
// rank must issue the same calls in the same order. Point-to-point send and recv are the exception:
// see send() for their rules. Issue calls from one thread at a time.
//
// Buffers: an async call reads `send` and writes `recv` (or `data`) until its Work is done:
// keep them alive, do not write a send buffer nor read a receive buffer before wait() returns
// or test() is true. A blocking call is done with them when it returns. Destroying the context
// finishes every call still queued.
//
// Counts are in elements of `dtype`; `send` may equal `recv` (in place). A bitwise op
// (kBand, kBor, kBxor) with a floating-point dtype is refused (kInvalidArgument). Every failure
// throws gradsync::Error (see error.h); after a failure inside a call, the communicator is aborted
// on every rank and later calls fail at once with kAborted.
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
  std::string transport_name(int peer) const;  // "shm", "tcp", "ucx", "inproc", "self"

  void allreduce(const void* send, void* recv, std::size_t count, DataType dtype, ReduceOp op,
                 const CallOptions& options = {});
  // `send` holds size() * recv_count elements; rank r receives block r reduced.
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DataType dtype,
                      ReduceOp op, const CallOptions& options = {});
  // `recv` receives size() * send_count elements, rank r's block at offset r * send_count.
  void allgather(const void* send, void* recv, std::size_t send_count, DataType dtype,
                 const CallOptions& options = {});
  // Rank r contributes recv_counts[r] elements; blocks are packed in rank order into recv.
  void allgatherv(const void* send, void* recv, std::span<const std::size_t> recv_counts,
                  DataType dtype, const CallOptions& options = {});
  void broadcast(void* data, std::size_t count, DataType dtype, int root,
                 const CallOptions& options = {});
  // Only `root` needs a `recv` buffer; other ranks may pass nullptr.
  void reduce(const void* send, void* recv, std::size_t count, DataType dtype, ReduceOp op,
              int root, const CallOptions& options = {});
  void barrier(const CallOptions& options = {});
  // `root` receives size() * count elements into `recv`, rank r's `send` at offset r * count
  // (root's `send` may already sit at its offset: in place). Other ranks may pass a null
  // `recv`.
  void gather(const void* send, void* recv, std::size_t count, DataType dtype, int root,
              const CallOptions& options = {});
  // Root's `send` holds size() * count elements; rank r receives block r (offset r * count)
  // into `recv` (root's `recv` may be its own block: in place). Other ranks may pass a null
  // `send`.
  void scatter(const void* send, void* recv, std::size_t count, DataType dtype, int root,
               const CallOptions& options = {});
  // `send` and `recv` hold size() blocks of `count` elements: block j of `send` goes to rank
  // j, block i of `recv` comes from rank i. Ranks exchange pairwise (step s: with r + s and
  // r - s), so no rank waits for the others one after another. `send` may equal `recv` (the
  // call then sends from a copy).
  void alltoall(const void* send, void* recv, std::size_t count, DataType dtype,
                const CallOptions& options = {});
  // As alltoall, with per-rank counts: `send` holds send_counts[j] elements for rank j and
  // `recv` recv_counts[i] from rank i, each packed in rank order (as allgatherv). Each pair
  // must agree: rank i's send_counts[j] == rank j's recv_counts[i] (and a rank's own two
  // entries); where they differ, the call fails with kMismatch naming both counts, before any
  // byte of that block is written.
  void alltoallv(const void* send, std::span<const std::size_t> send_counts, void* recv,
                 std::span<const std::size_t> recv_counts, DataType dtype,
                 const CallOptions& options = {});

  // Point-to-point: `count` elements from this rank to `peer` (send), or from `peer` into
  // `data` (recv). Only the two ranks issue it, and it does not count as a call of the others
  // (collectives stay numbered alike on every rank).
  //
  // Matching: per ordered pair of ranks, the k-th send from a to b is received by b's k-th
  // recv from a. Its count, dtype and `tag` must agree with the send's; where they do not,
  // the recv fails with kMismatch naming both sides, writing nothing past `data` (and, as
  // any failure inside a call, aborts the communicator). A tag is checked, not searched for:
  // messages with different tags are not reordered to match.
  //
  // Ordering (the rule gloo's backend of torch.distributed also has): a pair's sends and
  // receives travel in the same stream as the collectives' messages, and a collective starts
  // only once every send and recv issued before it on this rank is complete. So a send and
  // its recv must lie on the same side of every collective on both ranks: if rank a issues
  // send(b) before a collective, rank b issues the matching recv(a) before it too. Otherwise
  // the two ranks wait for each other until the timeout (a recv queued before a collective
  // whose send the peer issues after it), or fail with kMismatch.
  //
  // Sends and recvs run concurrently: each starts once the collectives before it are done
  // and the sends and recvs before it have started, without waiting for those to finish. So
  // send_async(b) and recv_async(b) on rank a with send_async(a) and recv_async(a) on rank
  // b, in either order, then wait(), complete for any size. A blocking send may wait until
  // the peer posts its recv (large messages are not buffered): two ranks that exchange with
  // blocking sends first can wait forever; post both async, then wait.
  //
  // The timeout (CallOptions::timeout, else Options::timeout) runs from when the call
  // starts: a recv posted long before the peer sends needs one that covers the wait.
  // `peer` must be another rank (kInvalidArgument). A peer that dies fails the call with
  // kPeerLost naming it; an error in one aborts the communicator, as for any call.
  void send(const void* data, std::size_t count, DataType dtype, int peer, int tag = 0,
            const CallOptions& options = {});
  void recv(void* data, std::size_t count, DataType dtype, int peer, int tag = 0,
            const CallOptions& options = {});

  Work allreduce_async(const void* send, void* recv, std::size_t count, DataType dtype, ReduceOp op,
                       const CallOptions& options = {});
  Work reduce_scatter_async(const void* send, void* recv, std::size_t recv_count, DataType dtype,
                            ReduceOp op, const CallOptions& options = {});
  Work allgather_async(const void* send, void* recv, std::size_t send_count, DataType dtype,
                       const CallOptions& options = {});
  // `recv_counts` is copied: it need not outlive the call.
  Work allgatherv_async(const void* send, void* recv, std::span<const std::size_t> recv_counts,
                        DataType dtype, const CallOptions& options = {});
  Work broadcast_async(void* data, std::size_t count, DataType dtype, int root,
                       const CallOptions& options = {});
  Work reduce_async(const void* send, void* recv, std::size_t count, DataType dtype, ReduceOp op,
                    int root, const CallOptions& options = {});
  Work barrier_async(const CallOptions& options = {});
  Work gather_async(const void* send, void* recv, std::size_t count, DataType dtype, int root,
                    const CallOptions& options = {});
  Work scatter_async(const void* send, void* recv, std::size_t count, DataType dtype, int root,
                     const CallOptions& options = {});
  Work alltoall_async(const void* send, void* recv, std::size_t count, DataType dtype,
                      const CallOptions& options = {});
  // The counts are copied: they need not outlive the call.
  Work alltoallv_async(const void* send, std::span<const std::size_t> send_counts, void* recv,
                       std::span<const std::size_t> recv_counts, DataType dtype,
                       const CallOptions& options = {});
  Work send_async(const void* data, std::size_t count, DataType dtype, int peer, int tag = 0,
                  const CallOptions& options = {});
  Work recv_async(void* data, std::size_t count, DataType dtype, int peer, int tag = 0,
                  const CallOptions& options = {});

  // The algorithm kAuto would use for an all-reduce of `bytes` (from the cost model).
  Algorithm choose_allreduce_algorithm(std::size_t bytes) const;
  // The cost model's constants, in the form Options::cost_model and GRADSYNC_COST_MODEL take
  // ("alpha_us=0.4,bandwidth_gbps=18,..."): measured at start-up unless configured. The
  // algorithms it picks decide how float32 sums round, so a run that must repeat another
  // bit for bit (a resumed one) passes the other's.
  std::string cost_model() const;
  // Which ranks share a host, as init() found them (or Options::topology set them):
  // "2 hosts: [0 2] [1 3]". Ring algorithms visit each host's ranks in a row.
  std::string topology() const;
  int hosts() const;            // hosts (or topology groups) the ranks span
  int host_of(int rank) const;  // 0..hosts()-1, hosts numbered by their lowest rank

  PeerTraffic traffic(int peer) const;
  PeerTraffic total_traffic() const;  // summed over peers

 private:
  friend struct detail::ContextAccess;
  std::unique_ptr<Impl> impl_;
};

// Builds a context from `options` and the environment; blocks until every rank has joined
// (bounded by the timeout).
std::unique_ptr<Context> init(const Options& options = {});

}  // namespace gradsync
