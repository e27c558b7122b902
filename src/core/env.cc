// Reads the launch environment of torchrun, mpirun, PMI and srun, and the GRADSYNC_* knobs,
// into Options.
#include "core/env.h"

#include <charconv>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>

#include "core/knobs.h"
#include "cost/cost_model.h"
#include "kernels/kernels.h"

namespace gradsync::env {

std::optional<std::string> get(const char* name) {
  const char* v = std::getenv(name);
  if (!v) return std::nullopt;
  return std::string(v);
}

std::optional<long long> first_int(const std::vector<const char*>& names) {
  for (const char* name : names) {
    auto v = get(name);
    if (!v) continue;
    long long n = 0;
    auto [ptr, ec] = std::from_chars(v->data(), v->data() + v->size(), n);
    if (ec != std::errc() || ptr != v->data() + v->size()) {
      throw Error(ErrorKind::kInvalidArgument,
                  std::string("environment variable ") + name + "='" + *v + "' is not an integer");
    }
    return n;
  }
  return std::nullopt;
}

namespace {

// A text knob: the explicit field if set, else the variable.
void take_text(std::string& field, const char* knob) {
  if (field.empty()) field = knobs::text(knob).value_or("");
}

// A count knob whose field is unset below 0: the explicit field if set, else the variable.
void take_count(int& field, const char* knob) {
  if (field >= 0) return;
  if (auto v = knobs::integer(knob, 0, std::numeric_limits<int>::max())) {
    field = static_cast<int>(*v);
  }
}

// GRADSYNC_TOPOLOGY: the groups inline, or after '@' the file that holds them.
std::string topology_from_environment(int rank) {
  auto spec = knobs::text("GRADSYNC_TOPOLOGY");
  if (!spec || !spec->starts_with('@')) return spec.value_or("");
  std::ifstream file(spec->substr(1));
  std::stringstream text;
  text << file.rdbuf();
  if (!file || text.str().empty()) {
    Error e = knobs::refusal("GRADSYNC_TOPOLOGY", *spec, "cannot read the file " + spec->substr(1));
    throw Error(e.kind(), e.detail(), rank);
  }
  return text.str();
}

}  // namespace

Options resolve(const Options& in) {
  Options o = in;
  auto pick = [](int explicit_value, const std::vector<const char*>& names, int fallback) {
    if (explicit_value >= 0) return explicit_value;
    auto v = first_int(names);
    return v ? static_cast<int>(*v) : fallback;
  };
  o.rank = pick(o.rank, {"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}, 0);
  o.size = pick(o.size, {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"}, 1);
  o.local_rank =
      pick(o.local_rank,
           {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}, -1);
  o.local_size = pick(o.local_size,
                      {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                       "SLURM_NTASKS_PER_NODE"},
                      -1);
  if (o.master_addr.empty()) o.master_addr = get("MASTER_ADDR").value_or("127.0.0.1");
  o.master_port = pick(o.master_port, {"MASTER_PORT"}, 29500);

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
    auto t = knobs::integer("GRADSYNC_TIMEOUT", 1, std::numeric_limits<long long>::max());
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
  take_count(o.tcp_liveness_s, "GRADSYNC_TCP_LIVENESS_S");
  take_count(o.tcp_socket_buffer_bytes, "GRADSYNC_TCP_SOCKBUF_BYTES");
  take_count(o.tcp_spin_us, "GRADSYNC_TCP_SPIN_US");
  take_count(o.shm_spin_us, "GRADSYNC_SHM_SPIN_US");
  // The process-wide knob the library reads lazily, in the kernels: a bad value fails here,
  // where an error is expected, rather than in the first collective.
  kernels::isa_name();

  if (o.size < 1) {
    throw Error(ErrorKind::kInvalidArgument,
                "world size must be >= 1, got " + std::to_string(o.size));
  }
  if (o.rank < 0 || o.rank >= o.size) {
    throw Error(
        ErrorKind::kInvalidArgument,
        "rank " + std::to_string(o.rank) + " is outside world size " + std::to_string(o.size));
  }
  if (!o.transport.empty() && o.transport != "shm" && o.transport != "tcp") {
    if (transport_from_environment) throw knobs::refusal("GRADSYNC_TRANSPORT", o.transport);
    throw Error(ErrorKind::kInvalidArgument,
                "transport '" + o.transport + "' is not one of shm, tcp", o.rank);
  }
  if (o.master_port < 0 || o.master_port > 65535) {
    throw Error(ErrorKind::kInvalidArgument,
                "MASTER_PORT " + std::to_string(o.master_port) + " is not a TCP port", o.rank);
  }
  return o;
}

}  // namespace gradsync::env
