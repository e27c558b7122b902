// The advisor's JSON files: hardware profiles (gradsync-probe's, and shipped ones) and
// workloads given as layer lists.
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "gradsync/advise.h"
#include "gradsync/error.h"

namespace gradsync::advise {

namespace {

using nlohmann::json;

Error unreadable(const std::string& path, const std::string& why,
                 const std::string& what = "profile") {
  return Error(ErrorKind::kInvalidArgument, what + " " + path + ": " + why, Error::kUnknownRank,
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
    take(j, "cache_mib", p.cache_mib);
    take(j, "shared_memory", p.shared_memory);
    take(j, "reduce_in_transfer", p.reduce_in_transfer);
    take(j, "compute_gflops", p.compute_gflops);
    take(j, "optimizer_gbps", p.optimizer_gbps);
    take(j, "memory_bytes_per_rank", p.memory_bytes_per_rank);
    take(j, "overlap_compute_speed", p.overlap_compute_speed);
    take(j, "overlap_comm_speed", p.overlap_comm_speed);
    take(j, "overlap_codec_compute_speed", p.overlap_codec_compute_speed);
    take(j, "overlap_codec_speed", p.overlap_codec_speed);
    if (j.contains("codecs")) {
      for (const auto& [name, speeds] : j.at("codecs").items()) {
        for (const json& at : speeds) {
          Profile::CodecSpeed speed;
          take(at, "floats", speed.floats);
          speed.encode_gbps = at.at("encode_gbps").get<double>();
          speed.decode_gbps = at.at("decode_gbps").get<double>();
          if (!(speed.encode_gbps > 0 && speed.decode_gbps > 0)) {
            throw unreadable(path,
                             "codec '" + name + "': encode_gbps and decode_gbps must be above 0");
          }
          p.codecs[name].push_back(speed);
        }
        if (p.codecs[name].empty()) throw unreadable(path, "codec '" + name + "' has no speeds");
      }
    }
    if (j.contains("timed")) {
      for (const json& t : j.at("timed")) {
        p.timed.push_back({t.at("collective").get<std::string>(), t.at("ranks").get<int>(),
                           t.at("hosts").get<int>(), t.at("bytes").get<std::size_t>(),
                           t.at("us").get<double>()});
        const auto& last = p.timed.back();
        const bool known = last.collective == "allreduce" || last.collective == "reduce_scatter" ||
                           last.collective == "allgather";
        if (!known || last.ranks < 1 || last.hosts < 1 || last.bytes == 0 || !(last.us > 0)) {
          throw unreadable(path,
                           "a timed entry needs a collective (allreduce, reduce_scatter, "
                           "allgather), ranks, hosts and bytes >= 1, and us > 0");
        }
      }
    }
  } catch (const json::exception& e) {
    throw unreadable(path, e.what());
  }
  const auto fraction = [](double speed) { return speed >= 0 && speed <= 1; };
  const bool positive = p.cores_per_host > 0 && p.intra.alpha_us >= 0 &&
                        p.intra.bandwidth_gbps > 0 && p.inter.alpha_us >= 0 &&
                        p.inter.bandwidth_gbps > 0 && p.reduce_gbps > 0 && p.copy_gbps > 0 &&
                        p.cache_mib >= 0 && p.compute_gflops > 0 && p.optimizer_gbps > 0 &&
                        fraction(p.overlap_compute_speed) && fraction(p.overlap_comm_speed) &&
                        fraction(p.overlap_codec_compute_speed) && fraction(p.overlap_codec_speed);
  if (!positive)
    throw unreadable(path,
                     "every speed and cores_per_host must be above 0, the overlap speeds in 0..1");
  if (p.name.empty()) p.name = path;
  return p;
}

Workload load_workload(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw unreadable(path, "cannot be opened", "workload");
  Workload w;
  w.name = path;
  try {
    const json j = json::parse(in);
    take(j, "name", w.name);
    take(j, "batch", w.batch);
    take(j, "optimizer", w.optimizer);
    for (const json& l : j.at("layers")) {
      Layer layer;
      take(l, "name", layer.name);
      if (l.contains("tensors")) {
        for (const json& t : l.at("tensors")) {
          Layer::Tensor tensor;
          take(t, "count", tensor.count);
          take(t, "rows", tensor.rows);
          layer.tensors.push_back(tensor);
        }
      } else {
        layer.tensors.push_back({l.at("parameters").get<std::size_t>(), 0});
      }
      take(l, "forward_flops", layer.forward_flops);
      take(l, "backward_flops", layer.backward_flops);
      take(l, "forward_ms", layer.forward_ms);
      take(l, "backward_ms", layer.backward_ms);
      const bool timed = layer.forward_ms > 0 || layer.forward_flops > 0;
      if (!timed || layer.forward_ms < 0 || layer.backward_ms < 0 || layer.forward_flops < 0 ||
          layer.backward_flops < 0) {
        throw unreadable(path,
                         "layer '" + layer.name +
                             "' needs forward_flops and backward_flops, or forward_ms and "
                             "backward_ms, none below 0",
                         "workload");
      }
      w.layers.push_back(std::move(layer));
    }
  } catch (const json::exception& e) {
    throw unreadable(path, e.what(), "workload");
  }
  if (w.layers.empty() || w.batch < 1) {
    throw unreadable(path, "needs at least one layer and a batch of at least 1", "workload");
  }
  return w;
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
      {"cache_mib", p.cache_mib},
      {"shared_memory", p.shared_memory},
      {"reduce_in_transfer", p.reduce_in_transfer},
      {"compute_gflops", p.compute_gflops},
      {"optimizer_gbps", p.optimizer_gbps},
      {"memory_bytes_per_rank", p.memory_bytes_per_rank},
      {"overlap_compute_speed", p.overlap_compute_speed},
      {"overlap_comm_speed", p.overlap_comm_speed},
      {"overlap_codec_compute_speed", p.overlap_codec_compute_speed},
      {"overlap_codec_speed", p.overlap_codec_speed}};
  json codecs = json::object();
  for (const auto& [name, speeds] : p.codecs) {
    for (const auto& at : speeds) {
      codecs[name].push_back({{"floats", at.floats},
                              {"encode_gbps", at.encode_gbps},
                              {"decode_gbps", at.decode_gbps}});
    }
  }
  json timed = json::array();
  for (const auto& t : p.timed) {
    timed.push_back({{"collective", t.collective},
                     {"ranks", t.ranks},
                     {"hosts", t.hosts},
                     {"bytes", t.bytes},
                     {"us", t.us}});
  }
  json out = j;
  out["codecs"] = codecs;
  out["timed"] = timed;
  return out.dump(2) + "\n";
}

}  // namespace gradsync::advise
