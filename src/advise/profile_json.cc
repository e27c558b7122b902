// Hardware profiles as JSON files: the shipped ones under profiles/, and gradsync-probe's.
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "gradsync/advise.h"
#include "gradsync/error.h"

namespace gradsync::advise {

namespace {

using nlohmann::json;

Error unreadable(const std::string& path, const std::string& why) {
  return Error(ErrorKind::kInvalidArgument, "profile " + path + ": " + why, Error::kUnknownRank,
               Error::kNoPeer, "advise");
}

template <class T>
void take(const json& j, const char* key, T& into) {
  if (j.contains(key)) into = j.at(key).get<T>();
}

void take_link(const json& j, const char* key, Link& into) {
  if (!j.contains(key)) return;
  take(j.at(key), "alpha_us", into.alpha_us);
  take(j.at(key), "bandwidth_gbps", into.bandwidth_gbps);
}

}  // namespace

Profile load_profile(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw unreadable(path, "cannot be opened");
  Profile p;
  try {
    const json j = json::parse(in);
    take(j, "name", p.name);
    take(j, "sources", p.sources);
    take(j, "cores_per_host", p.cores_per_host);
    take_link(j, "intra", p.intra);
    take_link(j, "inter", p.inter);
    take(j, "reduce_gbps", p.reduce_gbps);
    take(j, "copy_gbps", p.copy_gbps);
    take(j, "compute_gflops", p.compute_gflops);
    take(j, "optimizer_gbps", p.optimizer_gbps);
    take(j, "memory_bytes_per_rank", p.memory_bytes_per_rank);
    take(j, "encode_gbps", p.encode_gbps);
    take(j, "decode_gbps", p.decode_gbps);
  } catch (const json::exception& e) {
    throw unreadable(path, e.what());
  }
  const bool positive = p.cores_per_host > 0 && p.intra.alpha_us >= 0 &&
                        p.intra.bandwidth_gbps > 0 && p.inter.alpha_us >= 0 &&
                        p.inter.bandwidth_gbps > 0 && p.reduce_gbps > 0 && p.copy_gbps > 0 &&
                        p.compute_gflops > 0 && p.optimizer_gbps > 0;
  if (!positive) throw unreadable(path, "every speed and cores_per_host must be above 0");
  if (p.name.empty()) p.name = path;
  return p;
}

std::string profile_json(const Profile& p) {
  const json j = {
      {"name", p.name},
      {"sources", p.sources},
      {"cores_per_host", p.cores_per_host},
      {"intra", {{"alpha_us", p.intra.alpha_us}, {"bandwidth_gbps", p.intra.bandwidth_gbps}}},
      {"inter", {{"alpha_us", p.inter.alpha_us}, {"bandwidth_gbps", p.inter.bandwidth_gbps}}},
      {"reduce_gbps", p.reduce_gbps},
      {"copy_gbps", p.copy_gbps},
      {"compute_gflops", p.compute_gflops},
      {"optimizer_gbps", p.optimizer_gbps},
      {"memory_bytes_per_rank", p.memory_bytes_per_rank},
      {"encode_gbps", p.encode_gbps},
      {"decode_gbps", p.decode_gbps}};
  return j.dump(2) + "\n";
}

}  // namespace gradsync::advise
