// Reads a GRADSYNC_TIMELINE trace (Chrome trace events, one process row per rank) into the
// measured breakdown of each step, per bucket, and the ranks that hold the others back.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "gradsync/advise.h"
#include "gradsync/error.h"

namespace gradsync::advise {

namespace {

using nlohmann::json;

struct Event {
  std::string name, category;
  double start = 0, end = 0;  // s
  int thread = 0;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// Spans of `category` among one step's events that no other span of that category on the same
// thread contains: a layer's span inside "backward" is not counted twice.
double outer_seconds(const std::vector<const Event*>& step, const std::string& category) {
  double total = 0;
  for (const Event* e : step) {
    if (e->category != category) continue;
    const bool nested = std::any_of(step.begin(), step.end(), [&](const Event* o) {
      return o != e && o->category == category && o->thread == e->thread && o->start <= e->start &&
             o->end >= e->end && (o->start < e->start || o->end > e->end);
    });
    if (!nested) total += e->end - e->start;
  }
  return total;
}

// "allreduce bucket 3 (16384 KiB, none)" -> 3; -1 for any other name.
int bucket_of(const std::string& name) {
  const std::string prefix = "allreduce bucket ";
  if (name.rfind(prefix, 0) != 0) return -1;
  return std::atoi(name.c_str() + prefix.size());
}

constexpr std::size_t kWarmupSteps = 2;

}  // namespace

TraceReport read_trace(const std::string& path) {
  auto unreadable = [&](const std::string& why) {
    return Error(ErrorKind::kInvalidArgument, "trace " + path + ": " + why, Error::kUnknownRank,
                 Error::kNoPeer, "advise");
  };
  std::ifstream in(path);
  if (!in) throw unreadable("cannot be opened");
  std::map<int, std::vector<Event>> by_rank;
  try {
    const json j = json::parse(in);
    for (const json& e : j.at("traceEvents")) {
      if (e.value("ph", "") != "X") continue;
      const double start = e.at("ts").get<double>() * 1e-6;
      by_rank[e.at("pid").get<int>()].push_back(
          {e.at("name").get<std::string>(), e.value("cat", ""), start,
           start + e.at("dur").get<double>() * 1e-6, e.value("tid", 0)});
    }
  } catch (const json::exception& e) {
    throw unreadable(e.what());
  }
  // Each rank's steps. gradsync-train's end with its optimizer span; a PyTorch job's
  // (gradsync.torch's timeline) are "step" spans from one DDP forward to the next, holding
  // forward and backward as compute spans and gradsync's calls.
  std::vector<std::vector<MeasuredStep>> steps;  // [rank][step]
  std::vector<int> ranks;
  std::map<int, std::vector<double>> buckets;
  bool pytorch = false;
  for (auto& [rank, events] : by_rank) {
    std::sort(events.begin(), events.end(),
              [](const Event& a, const Event& b) { return a.start < b.start; });
    std::vector<MeasuredStep> mine;
    const auto add_step = [&](const std::vector<const Event*>& step, MeasuredStep m) {
      m.compute_s = outer_seconds(step, "compute");
      m.comm_s = outer_seconds(step, "comm");
      m.pack_s = outer_seconds(step, "pack");
      if (mine.size() >= kWarmupSteps) {
        int call = 0;  // a PyTorch step's all-reduces, in order: DDP's buckets
        for (const Event* b : step) {
          const int k = b->name.rfind("ALLREDUCE ", 0) == 0 ? call++ : bucket_of(b->name);
          if (k >= 0) buckets[k].push_back(b->end - b->start);
        }
      }
      mine.push_back(m);
    };
    const bool torch_steps = std::none_of(events.begin(), events.end(),
                                          [](const Event& e) { return e.category == "optimizer"; });
    if (torch_steps) {
      pytorch = true;
      for (const auto& window : events) {
        if (window.category != "step") continue;
        std::vector<const Event*> step;
        double compute_end = window.start, comm_end = window.start;
        // The events that start within the window (sorted by their start).
        const auto first = std::lower_bound(events.begin(), events.end(), window.start,
                                            [](const Event& e, double t) { return e.start < t; });
        for (auto it = first; it != events.end() && it->start < window.end; ++it) {
          const Event& e = *it;
          if (&e == &window) continue;
          step.push_back(&e);
          if (e.category == "compute") compute_end = std::max(compute_end, e.end);
          if (e.category == "comm") comm_end = std::max(comm_end, e.end);
        }
        MeasuredStep m;
        m.step_s = window.end - window.start;
        // What DDP waited for after backward, and all that follows until the next forward
        // (the optimizer, zeroing the gradients, the next batch).
        m.exposed_comm_s = std::max(0.0, comm_end - compute_end);
        m.optimizer_s = std::max(0.0, window.end - std::max(compute_end, comm_end));
        add_step(step, m);
      }
    } else {
      std::vector<const Event*> step;  // this step's events so far
      double previous_end = -1;  // of the last optimizer span: what lies between is the step's
      for (const auto& e : events) {
        step.push_back(&e);
        if (e.category != "optimizer") continue;
        MeasuredStep m;
        m.step_s = e.end - (previous_end >= 0 ? previous_end : step.front()->start);
        previous_end = e.end;
        m.exposed_comm_s = outer_seconds(step, "wait");
        m.optimizer_s = e.end - e.start;
        add_step(step, m);
        step.clear();
      }
    }
    steps.push_back(std::move(mine));
    ranks.push_back(rank);
  }
  std::size_t common = steps.empty() ? 0 : steps.front().size();
  for (const auto& s : steps) common = std::min(common, s.size());
  if (common <= kWarmupSteps) {
    throw unreadable("holds " + std::to_string(common) +
                     " complete steps on every rank; at least " + std::to_string(kWarmupSteps + 1) +
                     " are needed (spans of category \"optimizer\" end each step of "
                     "gradsync-train; spans of category \"step\" are a PyTorch job's)");
  }
  TraceReport r;
  r.pytorch = pytorch;
  r.ranks = static_cast<int>(steps.size());
  r.steps = common;
  std::vector<double> step, compute, comm, exposed, pack, optimizer;
  std::vector<int> slowest_compute(steps.size(), 0);
  for (std::size_t i = kWarmupSteps; i < common; ++i) {
    std::size_t slowest = 0, lagging = 0;
    for (std::size_t k = 0; k < steps.size(); ++k) {
      // Ranks leave a synchronous step together: a tie goes to the one that computed longest.
      const double longer = steps[k][i].step_s - steps[slowest][i].step_s;
      if (longer > 1e-6 ||
          (longer > -1e-6 && steps[k][i].compute_s > steps[slowest][i].compute_s)) {
        slowest = k;
      }
      if (steps[k][i].compute_s > steps[lagging][i].compute_s) lagging = k;
    }
    ++slowest_compute[lagging];
    const MeasuredStep& m = steps[slowest][i];
    step.push_back(m.step_s);
    compute.push_back(m.compute_s);
    comm.push_back(m.comm_s);
    exposed.push_back(m.exposed_comm_s);
    pack.push_back(m.pack_s);
    optimizer.push_back(m.optimizer_s);
  }
  r.median = {median(step),    median(compute), median(comm),
              median(exposed), median(pack),    median(optimizer)};
  for (const auto& [k, times] : buckets) {
    if (static_cast<std::size_t>(k) >= r.bucket_s.size()) r.bucket_s.resize(k + 1);
    r.bucket_s[static_cast<std::size_t>(k)] = median(times);
  }
  // A straggler computes longest in most steps, and by more than noise (5%) over the other
  // ranks' median: they wait for it at every all-reduce.
  std::vector<double> rank_compute;
  for (const auto& s : steps) {
    std::vector<double> c;
    for (std::size_t i = kWarmupSteps; i < common; ++i) c.push_back(s[i].compute_s);
    rank_compute.push_back(median(c));
  }
  const std::size_t counted = common - kWarmupSteps;
  for (std::size_t k = 0; k < steps.size() && steps.size() > 1; ++k) {
    std::vector<double> others = rank_compute;
    others.erase(others.begin() + static_cast<std::ptrdiff_t>(k));
    const double typical = median(others);
    if (2 * static_cast<std::size_t>(slowest_compute[k]) > counted &&
        rank_compute[k] > 1.05 * typical) {
      std::ostringstream o;
      o << "rank " << ranks[k] << " computes longest in " << slowest_compute[k] << " of " << counted
        << " steps, " << std::lround(100 * (rank_compute[k] / typical - 1))
        << "% longer than the other ranks' median: every all-reduce waits for it";
      r.stragglers.push_back(o.str());
    }
  }
  return r;
}

}  // namespace gradsync::advise
