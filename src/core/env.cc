// Reads the launch environment of torchrun, mpirun, PMI and srun into Options.
#include "core/env.h"

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>

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

void log_override(const char* name, const std::string& value) {
  static std::mutex mu;
  static std::set<std::string> logged;
  std::lock_guard lock(mu);
  if (!logged.insert(name).second) return;
  if (auto r = get("RANK"); r && *r != "0") return;
  if (get("GRADSYNC_QUIET")) return;
  std::fprintf(stderr, "gradsync: %s=%s (from environment)\n", name, value.c_str());
}

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
  if (o.token.empty()) o.token = get("GRADSYNC_TOKEN").value_or("");
  if (o.topology.empty()) {
    if (auto t = get("GRADSYNC_TOPOLOGY")) {
      log_override("GRADSYNC_TOPOLOGY", *t);
      o.topology = *t;
      if (t->starts_with('@')) {  // @path: the groups are in a file, one line per group
        std::ifstream file(t->substr(1));
        std::stringstream text;
        text << file.rdbuf();
        if (!file || text.str().empty()) {
          throw Error(ErrorKind::kInvalidArgument,
                      "GRADSYNC_TOPOLOGY=" + *t + ": cannot read the file " + t->substr(1), o.rank);
        }
        o.topology = text.str();
      }
    }
  }
  if (o.transport.empty()) {
    if (auto t = get("GRADSYNC_TRANSPORT")) {
      o.transport = *t;
      log_override("GRADSYNC_TRANSPORT", *t);
    }
  }
  if (o.algorithm == Algorithm::kAuto) {
    if (auto a = get("GRADSYNC_ALGO")) {
      auto parsed = parse_algorithm(*a);
      if (!parsed) {
        throw Error(ErrorKind::kInvalidArgument,
                    "GRADSYNC_ALGO='" + *a + "' is not one of auto, ring, rd, hd, ps, shm");
      }
      o.algorithm = *parsed;
      log_override("GRADSYNC_ALGO", *a);
    }
  }
  if (o.timeout.count() <= 0) {
    auto t = first_int({"GRADSYNC_TIMEOUT"});
    if (t) log_override("GRADSYNC_TIMEOUT", std::to_string(*t));
    o.timeout = std::chrono::milliseconds(t && *t > 0 ? *t : 300000);
  }

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
