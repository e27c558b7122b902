// Reads the launch environment of torchrun, mpirun, PMI and srun, and the GRADSYNC_* knobs,
// into Options.
#include "core/env.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <sstream>

#include "core/knobs.h"
#include "cost/cost_model.h"
#include "kernels/kernels.h"

namespace gradsync::env {

namespace {

// A text knob: the explicit field if set, else the variable.
void take_text(std::string& field, const char* knob) {
  if (field.empty()) field = knobs::text(knob).value_or("");
}

// A count knob whose field is unset below 0: the explicit field if set, else the variable.
void take_count(int& field, const char* knob) {
  if (field >= 0) return;
  if (auto v = knobs::integer(knob)) field = static_cast<int>(*v);
}

// A launcher's integer, which each launcher names its own way: the first of `names` that is
// set, and which one that was, for the error if it disagrees with another variable.
struct Launched {
  const char* name = nullptr;  // nullptr: the field was given, or nothing set it
  long long value = 0;
};

// The explicit field if set (>= 0), else the first of `names` that is set, else `fallback`.
int take_launched(int explicit_value, std::initializer_list<const char*> names, int fallback,
                  Launched& source) {
  if (explicit_value >= 0) return explicit_value;
  for (const char* name : names) {
    if (auto v = knobs::integer(name)) {
      source = {name, *v};
      return static_cast<int>(*v);  // the registry's range fits an int
    }
  }
  return fallback;
}

// `value` (of the variable `source` names, or of `field`) is not below `bound`.
Error not_below(const Launched& source, const char* field, int value, const char* bound_name,
                int bound) {
  const std::string why = std::string(bound_name) + " is " + std::to_string(bound);
  if (source.name) return knobs::refusal(source.name, std::to_string(source.value), why);
  return Error(ErrorKind::kInvalidArgument, std::string(field) + " " + std::to_string(value) +
                                                " is outside [0, " + std::to_string(bound) +
                                                "): " + why);
}

// A topology file names each rank once: a million ranks fit in a few MiB.
constexpr off_t kMaxTopologyFileBytes = off_t{16} << 20;

// GRADSYNC_TOPOLOGY: the groups inline, or after '@' the file that holds them.
std::string topology_from_environment(int rank) {
  auto spec = knobs::text("GRADSYNC_TOPOLOGY");
  if (!spec || !spec->starts_with('@')) return spec.value_or("");
  const std::string path = spec->substr(1);
  auto refuse = [&](const std::string& why) {
    Error e = knobs::refusal("GRADSYNC_TOPOLOGY", *spec, "the file " + path + " " + why);
    return Error(e.kind(), e.detail(), rank);
  };
  // A regular file of a sane size only: reading a FIFO would block init() forever, a device
  // like /dev/zero until memory runs out.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw refuse(std::string("cannot be read: ") + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) throw refuse("is not a regular file");
  if (st.st_size > kMaxTopologyFileBytes) {
    throw refuse("holds " + std::to_string(st.st_size) + " bytes, more than a topology's " +
                 std::to_string(kMaxTopologyFileBytes));
  }
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  if (!file || text.str().empty()) throw refuse("cannot be read or is empty");
  return text.str();
}

}  // namespace

Options resolve(const Options& in) {
  Options o = in;
  Launched rank_from, local_rank_from, unused;
  o.rank = take_launched(o.rank, {"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}, 0,
                         rank_from);
  o.size = take_launched(o.size, {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"},
                         1, unused);
  // A caller that brings its own store and names the rank and size describes a group of its
  // own (a torch process group, a subgroup): the launcher's LOCAL_* describe the whole job,
  // so this group's ranks per host come from host discovery instead.
  const bool own_group = in.store && in.rank >= 0 && in.size >= 1;
  o.local_rank = own_group ? o.local_rank
                           : take_launched(o.local_rank,
                                           {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                                            "MPI_LOCALRANKID", "SLURM_LOCALID"},
                                           -1, local_rank_from);
  o.local_size = own_group ? o.local_size
                           : take_launched(o.local_size,
                                           {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                                            "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"},
                                           -1, unused);
  if (o.master_addr.empty()) o.master_addr = knobs::text("MASTER_ADDR").value_or("127.0.0.1");
  if (o.master_port < 0) {
    o.master_port = static_cast<int>(knobs::integer("MASTER_PORT").value_or(29500));
    // torchrun's agent already listens there with torch's store, which gradsync's store
    // protocol cannot share; every rank it starts moves to the next port alike.
    if (!o.store && knobs::text("TORCHELASTIC_RUN_ID")) ++o.master_port;
  }
  // The ranks before anything else: later errors name this rank.
  if (o.size < 1 || o.size > knobs::kMaxWorldSize) {
    throw Error(ErrorKind::kInvalidArgument, "world size " + std::to_string(o.size) +
                                                 " is outside [1, " +
                                                 std::to_string(knobs::kMaxWorldSize) + "]");
  }
  if (o.rank >= o.size) throw not_below(rank_from, "rank", o.rank, "the world size", o.size);
  if (o.local_size == 0 || o.local_size > knobs::kMaxWorldSize) {
    throw Error(ErrorKind::kInvalidArgument, "local world size " + std::to_string(o.local_size) +
                                                 " is outside [1, " +
                                                 std::to_string(knobs::kMaxWorldSize) + "]");
  }
  if (o.local_size > 0 && o.local_rank >= o.local_size) {
    throw not_below(local_rank_from, "local rank", o.local_rank, "the local world size",
                    o.local_size);
  }
  if (o.master_port < 1 || o.master_port > 65535) {
    throw Error(ErrorKind::kInvalidArgument,
                "master port " + std::to_string(o.master_port) + " is outside [1, 65535]", o.rank);
  }

  take_text(o.token, "GRADSYNC_TOKEN");
  const bool transport_from_environment = o.transport.empty();
  take_text(o.transport, "GRADSYNC_TRANSPORT");
  if (o.topology.empty()) o.topology = topology_from_environment(o.rank);
  if (o.algorithm == Algorithm::kAuto) {
    if (auto a = knobs::text("GRADSYNC_ALGO")) {
      auto parsed = parse_algorithm(*a);
      if (!parsed) throw knobs::refusal("GRADSYNC_ALGO", *a);
      o.algorithm = *parsed;
    }
  }
  if (o.timeout.count() <= 0) {
    auto t = knobs::integer("GRADSYNC_TIMEOUT");
    o.timeout = t ? std::chrono::milliseconds(*t) : kDefaultTimeout;
  }
  if (o.cost_model.empty()) {
    o.cost_model = knobs::text("GRADSYNC_COST_MODEL").value_or("");
    if (!o.cost_model.empty() && !cost::CostModel::parse(o.cost_model)) {
      throw knobs::refusal("GRADSYNC_COST_MODEL", o.cost_model);
    }
  }
  take_text(o.host_id, "GRADSYNC_HOST_ID");
  take_text(o.socket_ifname, "GRADSYNC_SOCKET_IFNAME");
  take_text(o.socket_addr, "GRADSYNC_SOCKET_ADDR");
  take_text(o.store_bind, "GRADSYNC_STORE_BIND");
  take_count(o.tcp_liveness_s, "GRADSYNC_TCP_LIVENESS_S");
  take_count(o.tcp_socket_buffer_bytes, "GRADSYNC_TCP_SOCKBUF_BYTES");
  take_count(o.tcp_spin_us, "GRADSYNC_TCP_SPIN_US");
  take_count(o.shm_spin_us, "GRADSYNC_SHM_SPIN_US");
  // The process-wide knob the library reads lazily, in the kernels: a bad value fails here,
  // where an error is expected, rather than in the first collective.
  kernels::isa_name();

  if (!o.transport.empty() && o.transport != "shm" && o.transport != "tcp" &&
      o.transport != "ucx" && o.transport != "shm+ucx") {
    if (transport_from_environment) throw knobs::refusal("GRADSYNC_TRANSPORT", o.transport);
    throw Error(ErrorKind::kInvalidArgument,
                "transport '" + o.transport + "' is not one of shm, tcp, ucx, shm+ucx", o.rank);
  }
  return o;
}

}  // namespace gradsync::env
