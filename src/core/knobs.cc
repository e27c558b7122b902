// The knob registry (see knobs.h): the rows, and reading, validating and logging a variable.
#include "core/knobs.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>

namespace gradsync::knobs {

namespace {

using enum Scope;

// README's tables show these rows (name, setter, default, accepts): the GRADSYNC_* knobs in
// one, the launcher's variables in another; tests/knobs_test.cc keeps them in step. Keep the
// rows sorted by name.
constexpr long long kMaxRank = kMaxWorldSize - 1;
constexpr Knob kKnobs[] = {
    {"GRADSYNC_ALGO", "auto",
     "one of auto, ring, rd (or recursive_doubling), hd (or halving_doubling, rabenseifner), ps "
     "(or parameter_server), shm (or shared_memory), hier (or hierarchical)",
     "Options::algorithm",
     "The all-reduce algorithm of every call; auto: the cost model's choice per call.", kContext},
    {"GRADSYNC_COST_MODEL", "measured at start-up",
     "a cost model like alpha_us=0.4,bandwidth_gbps=18 (as Context::cost_model() prints it)",
     "Options::cost_model",
     "The cost model's constants instead of a start-up measurement; a run that must repeat "
     "another bit for bit passes the other's.",
     kContext},
    {"GRADSYNC_HOST_ID", "hostname, boot id and network namespace", "any text", "Options::host_id",
     "Ranks with the same id are one host: they use shared memory.", kContext},
    {"GRADSYNC_KERNELS_ISA", "auto", "one of auto, scalar",
     "none: process-wide (one set of kernels serves every context)",
     "scalar: never use the AVX2 kernels.", kProcess},
    {"GRADSYNC_QUIET", "unset", "any value", "none: process-wide (it silences the log itself)",
     "Set: no line on stderr for variables the environment sets.", kProcess},
    // Spinning longer than a second is never cheaper than sleeping.
    {"GRADSYNC_SHM_SPIN_US", "20, or 100 yielding when ranks share cores",
     "an integer in [0, 1000000] (microseconds)", "Options::shm_spin_us",
     "How long an idle shared-memory waiter looks for progress before it sleeps; 0: at once.",
     kContext, true, 0, 1000000},
    {"GRADSYNC_SOCKET_ADDR", "the local address that routes to MASTER_ADDR",
     "an address peers can dial", "Options::socket_addr",
     "The address the tcp transport advertises to peers (it listens on all); "
     "GRADSYNC_SOCKET_IFNAME takes precedence.",
     kContext},
    {"GRADSYNC_SOCKET_IFNAME", "unset: every interface", "a network interface with an IPv4 address",
     "Options::socket_ifname",
     "The interface whose address every socket binds to and advertises, the store's included "
     "(like NCCL_SOCKET_IFNAME).",
     kContext},
    // A day; TCP_USER_TIMEOUT takes it in milliseconds, as an unsigned int.
    {"GRADSYNC_STORE_BIND", "GRADSYNC_SOCKET_IFNAME's address, else MASTER_ADDR if local, else all",
     "an address of this host, or 0.0.0.0 for every interface", "Options::store_bind",
     "Where the store rank 0 hosts listens; the default keeps a store for 127.0.0.1 off the "
     "network.",
     kContext},
    {"GRADSYNC_TCP_LIVENESS_S", "15", "an integer in [0, 86400] (seconds)",
     "Options::tcp_liveness_s",
     "A peer whose host stops answering is declared lost after about this long; 0: never.",
     kContext, true, 0, 86400},
    // 1 GiB: setsockopt takes an int, which the kernel doubles.
    {"GRADSYNC_TCP_SOCKBUF_BYTES", "0", "an integer in [0, 1073741824] (bytes)",
     "Options::tcp_socket_buffer_bytes",
     "SO_SNDBUF and SO_RCVBUF of every connection; 0: the kernel's autotuning.", kContext, true, 0,
     1 << 30},
    {"GRADSYNC_TCP_SPIN_US", "50, or 100 yielding when ranks share cores",
     "an integer in [0, 1000000] (microseconds)", "Options::tcp_spin_us",
     "How long a waiting caller polls its sockets before it sleeps in poll(); 0: at once.",
     kContext, true, 0, 1000000},
    {"GRADSYNC_TIMELINE", "unset: no timeline", "a file path",
     "none: process-wide; timeline::enable() and timeline::write(ctx, path)",
     "Records a Chrome-trace timeline; timeline::write() writes it to this file.", kProcess},
    // About 24.8 days: the longest wait poll() takes, and a deadline steady_clock can hold.
    {"GRADSYNC_TIMEOUT", "300000", "an integer in [1, 2147483647] (milliseconds)",
     "Options::timeout",
     "The deadline of every blocking wait, setup included; a wait past it then spends up to 2 s "
     "finding the rank the job waits for.",
     kContext, true, 1, 2147483647},
    {"GRADSYNC_TOKEN", "unset: no secret", "any text", "Options::token",
     "The job's secret every connection proves by challenge-response, never sending it "
     "(gradsync-run sets one); never logged.",
     kContext, false},
    {"GRADSYNC_TOPOLOGY", "the ranks of each host",
     "groups like 0,2;1,3 (every rank once), or @file with a group a line", "Options::topology",
     "Groups of ranks the ring keeps together, where host detection cannot see them; the same "
     "on every rank.",
     kContext},
    {"GRADSYNC_TRANSPORT", "shm within a host, tcp across", "one of shm, tcp, ucx, shm+ucx",
     "Options::transport",
     "The transport between every two ranks: ucx carries every peer through UCX (RDMA where "
     "UCX finds it; UCX_TLS and UCX_NET_DEVICES pick its devices), shm+ucx only those on "
     "other hosts.",
     kContext},
    {"GRADSYNC_UCX_LIBRARY", "libucp.so.0", "a shared library name or path",
     "none: process-wide (UCX is loaded once)",
     "The UCX library the ucx transport loads, where it is not the system's libucp.so.0 (a UCX "
     "built elsewhere).",
     kProcess},
    {"LOCAL_RANK", "unset: from host discovery", "an integer in [0, LOCAL_WORLD_SIZE)",
     "Options::local_rank", "This rank's index on its host (torchrun, gradsync-run).", kLauncher,
     false, 0, kMaxRank},
    {"LOCAL_WORLD_SIZE", "unset: from host discovery", "an integer in [1, 1048576]",
     "Options::local_size", "The ranks on this host (torchrun, gradsync-run).", kLauncher, false, 1,
     kMaxWorldSize},
    {"MASTER_ADDR", "127.0.0.1", "a host name or address", "Options::master_addr",
     "The host of rank 0's rendezvous store.", kLauncher, false},
    {"MASTER_PORT", "29500", "an integer in [1, 65535]", "Options::master_port",
     "The port of rank 0's rendezvous store (under torchrun, the next one: TORCHELASTIC_RUN_ID).",
     kLauncher, false, 1, 65535},
    {"MPI_LOCALNRANKS", "unset", "an integer in [1, 1048576]", "Options::local_size",
     "LOCAL_WORLD_SIZE under MPICH's Hydra; read when LOCAL_WORLD_SIZE and "
     "OMPI_COMM_WORLD_LOCAL_SIZE are unset.",
     kLauncher, false, 1, kMaxWorldSize},
    {"MPI_LOCALRANKID", "unset", "an integer in [0, LOCAL_WORLD_SIZE)", "Options::local_rank",
     "LOCAL_RANK under MPICH's Hydra; read when LOCAL_RANK and OMPI_COMM_WORLD_LOCAL_RANK are "
     "unset.",
     kLauncher, false, 0, kMaxRank},
    {"OMPI_COMM_WORLD_LOCAL_RANK", "unset", "an integer in [0, LOCAL_WORLD_SIZE)",
     "Options::local_rank", "LOCAL_RANK under Open MPI's mpirun; read when LOCAL_RANK is unset.",
     kLauncher, false, 0, kMaxRank},
    {"OMPI_COMM_WORLD_LOCAL_SIZE", "unset", "an integer in [1, 1048576]", "Options::local_size",
     "LOCAL_WORLD_SIZE under Open MPI's mpirun; read when LOCAL_WORLD_SIZE is unset.", kLauncher,
     false, 1, kMaxWorldSize},
    {"OMPI_COMM_WORLD_RANK", "unset", "an integer in [0, WORLD_SIZE)", "Options::rank",
     "RANK under Open MPI's mpirun; read when RANK is unset.", kLauncher, false, 0, kMaxRank},
    {"OMPI_COMM_WORLD_SIZE", "unset", "an integer in [1, 1048576]", "Options::size",
     "WORLD_SIZE under Open MPI's mpirun; read when WORLD_SIZE is unset.", kLauncher, false, 1,
     kMaxWorldSize},
    {"PMI_RANK", "unset", "an integer in [0, WORLD_SIZE)", "Options::rank",
     "RANK under PMI (MPICH, Intel MPI); read when RANK and OMPI_COMM_WORLD_RANK are unset.",
     kLauncher, false, 0, kMaxRank},
    {"PMI_SIZE", "unset", "an integer in [1, 1048576]", "Options::size",
     "WORLD_SIZE under PMI (MPICH, Intel MPI); read when WORLD_SIZE and OMPI_COMM_WORLD_SIZE "
     "are unset.",
     kLauncher, false, 1, kMaxWorldSize},
    {"RANK", "0", "an integer in [0, WORLD_SIZE)", "Options::rank",
     "This rank's index in the job (torchrun, gradsync-run).", kLauncher, false, 0, kMaxRank},
    {"SLURM_LOCALID", "unset", "an integer in [0, LOCAL_WORLD_SIZE)", "Options::local_rank",
     "LOCAL_RANK under srun; read when LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK and "
     "MPI_LOCALRANKID are unset.",
     kLauncher, false, 0, kMaxRank},
    {"SLURM_NTASKS", "unset", "an integer in [1, 1048576]", "Options::size",
     "WORLD_SIZE under srun; read when WORLD_SIZE, OMPI_COMM_WORLD_SIZE and PMI_SIZE are unset.",
     kLauncher, false, 1, kMaxWorldSize},
    {"SLURM_NTASKS_PER_NODE", "unset", "an integer in [1, 1048576]", "Options::local_size",
     "LOCAL_WORLD_SIZE under srun; read when LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE and "
     "MPI_LOCALNRANKS are unset.",
     kLauncher, false, 1, kMaxWorldSize},
    {"SLURM_PROCID", "unset", "an integer in [0, WORLD_SIZE)", "Options::rank",
     "RANK under srun; read when RANK, OMPI_COMM_WORLD_RANK and PMI_RANK are unset.", kLauncher,
     false, 0, kMaxRank},
    {"TORCHELASTIC_RUN_ID", "unset", "any text", "Options::master_port",
     "Set by torchrun, whose agent hosts torch's own store on MASTER_PORT: gradsync's store "
     "(C++ programs, gradsync.init()) then uses MASTER_PORT + 1.",
     kLauncher, false},
    {"WORLD_SIZE", "1", "an integer in [1, 1048576]", "Options::size",
     "The ranks of the job (torchrun, gradsync-run).", kLauncher, false, 1, kMaxWorldSize},
};

std::optional<std::string> from_environment(std::string_view name) {
  const char* v = std::getenv(std::string(name).c_str());
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

// What the environment held when the process first asked, for Scope::kProcess knobs.
std::optional<std::string> read_once(std::string_view name) {
  static std::mutex mu;
  static std::map<std::string_view, std::optional<std::string>> seen;
  std::lock_guard lock(mu);
  auto [it, fresh] = seen.try_emplace(name);
  if (fresh) it->second = from_environment(name);
  return it->second;
}

// The value without logging it: log_override itself needs GRADSYNC_QUIET this way.
std::optional<std::string> unlogged(const Knob& knob) {
  return knob.scope == kProcess ? read_once(knob.name) : from_environment(knob.name);
}

}  // namespace

std::span<const Knob> all() {
  return kKnobs;
}

const Knob& find(std::string_view name) {
  for (const Knob& knob : kKnobs) {
    if (knob.name == name) return knob;
  }
  throw std::logic_error("gradsync: " + std::string(name) +
                         " is not in the knob registry (src/core/knobs.cc)");
}

std::optional<std::string> foreign_text(std::string_view name) {
  if (name.starts_with("GRADSYNC_") ||
      std::any_of(all().begin(), all().end(), [&](const Knob& k) { return k.name == name; })) {
    throw std::logic_error(std::string(name) + " is gradsync's: read it with knobs::text");
  }
  return from_environment(name);
}

std::optional<std::string> text(std::string_view name) {
  const Knob& knob = find(name);
  auto value = unlogged(knob);
  if (value && knob.logged) log_override(knob.name, *value);
  return value;
}

std::optional<long long> integer(std::string_view name) {
  const Knob& knob = find(name);
  if (knob.min >= knob.max) {
    throw std::logic_error("gradsync: " + std::string(name) + " is no integer knob");
  }
  auto value = text(name);
  if (!value) return std::nullopt;
  long long n = 0;
  const char* end = value->data() + value->size();
  // from_chars takes no space and no '+', and says when the digits overflow long long.
  auto [ptr, ec] = std::from_chars(value->data(), end, n);
  if (ec != std::errc() || ptr != end || n < knob.min || n > knob.max) throw refusal(name, *value);
  return n;
}

Error refusal(std::string_view name, const std::string& value, const std::string& detail) {
  const Knob& knob = find(name);
  return Error(ErrorKind::kInvalidArgument, std::string(knob.name) + "='" + value + "' is not " +
                                                std::string(knob.accepts) +
                                                (detail.empty() ? "" : ": " + detail));
}

void log_override(std::string_view name, const std::string& value) {
  static std::mutex mu;
  static std::set<std::string, std::less<>> logged;
  const Knob& knob = find(name);
  std::lock_guard lock(mu);
  if (!logged.insert(std::string(name)).second) return;
  if (auto rank = from_environment("RANK"); rank && *rank != "0") return;
  if (unlogged(find("GRADSYNC_QUIET"))) return;
  const std::string line = "gradsync: " + std::string(knob.name) + "=" + value +
                           " (from environment; default " + std::string(knob.default_text) + ")\n";
  std::fputs(line.c_str(), stderr);
}

}  // namespace gradsync::knobs
