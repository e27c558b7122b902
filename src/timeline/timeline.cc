// The Chrome-trace timeline (see timeline.h): spans are appended under one mutex per
// process (a few per bucket and step, not per element), and gathered at write time.
#include "gradsync/timeline.h"

#include <atomic>
#include <chrono>
#include <fstream>
#include <map>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include "core/knobs.h"
#include "gradsync/error.h"

namespace gradsync::timeline {

namespace {

struct Event {
  std::string name;
  const char* category;
  std::int64_t start_us, end_us;
  int thread;
};

struct Recorder {
  std::mutex mu;
  std::vector<Event> events;
  std::map<std::thread::id, int> threads;  // small numbers for the trace's tracks
};

Recorder& recorder() {
  static Recorder r;
  return r;
}

std::atomic<bool>& forced() {
  static std::atomic<bool> on{false};
  return on;
}

const std::string& env_path() {
  static const std::string path = knobs::text("GRADSYNC_TIMELINE").value_or("");
  return path;
}

void append_escaped(std::string& out, const std::string& s) {
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
}

}  // namespace

bool enabled() {
  return forced().load(std::memory_order_relaxed) || !env_path().empty();
}

void enable() {
  forced().store(true);
}

std::int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void record(std::string name, const char* category, std::int64_t start_us, std::int64_t end_us) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  auto [it, fresh] =
      r.threads.emplace(std::this_thread::get_id(), static_cast<int>(r.threads.size()));
  (void)fresh;
  r.events.push_back({std::move(name), category, start_us, end_us, it->second});
}

std::size_t write(Context& ctx, const std::string& path) {
  const std::string target = path.empty() ? env_path() : path;
  // Every rank takes part in the exchange if any would: the decision is agreed first.
  std::int64_t want = !target.empty() && enabled() ? 1 : 0;
  ctx.allreduce(&want, &want, 1, DataType::kInt64, ReduceOp::kMax);
  if (!want) return 0;
  std::string mine;
  std::int64_t count = 0;
  {
    Recorder& r = recorder();
    std::lock_guard<std::mutex> lock(r.mu);
    for (const Event& e : r.events) {
      mine += "{\"name\":\"";
      append_escaped(mine, e.name);
      mine += "\",\"cat\":\"" + std::string(e.category) +
              "\",\"ph\":\"X\",\"ts\":" + std::to_string(e.start_us) +
              ",\"dur\":" + std::to_string(e.end_us - e.start_us) +
              ",\"pid\":" + std::to_string(ctx.rank()) + ",\"tid\":" + std::to_string(e.thread) +
              "},\n";
    }
    mine += "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + std::to_string(ctx.rank()) +
            ",\"args\":{\"name\":\"rank " + std::to_string(ctx.rank()) + "\"}},\n";
    count = static_cast<std::int64_t>(r.events.size());
    r.events.clear();
  }
  const auto n = static_cast<std::size_t>(ctx.size());
  std::int64_t sizes_mine[2] = {static_cast<std::int64_t>(mine.size()), count};
  std::vector<std::int64_t> sizes(2 * n);
  ctx.allgather(sizes_mine, sizes.data(), 2, DataType::kInt64);
  std::vector<std::size_t> bytes(n);
  std::size_t events = 0;
  for (std::size_t r = 0; r < n; ++r) {
    bytes[r] = static_cast<std::size_t>(sizes[2 * r]);
    events += static_cast<std::size_t>(sizes[2 * r + 1]);
  }
  std::string all(std::accumulate(bytes.begin(), bytes.end(), std::size_t{0}), '\0');
  ctx.allgatherv(mine.data(), all.data(), bytes, DataType::kUInt8);
  if (ctx.rank() != 0) return 0;
  std::ofstream f(target);
  if (!f) {
    throw Error(ErrorKind::kSystem, "cannot write the timeline to '" + target + "'", ctx.rank(),
                Error::kNoPeer, "timeline");
  }
  if (all.size() >= 2) all.resize(all.size() - 2);  // the last ",\n"
  f << "{\"traceEvents\":[\n" << all << "\n],\"displayTimeUnit\":\"ms\"}\n";
  return events;
}

}  // namespace gradsync::timeline
