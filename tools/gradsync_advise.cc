// gradsync-advise: predicts one training step of gradsync-train's configuration on a cluster
// (a hardware profile, or flags describing one), names its bottleneck, and ranks the changes
// that the step model predicts to be faster. Pure arithmetic: it runs no rank.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

#include "flag_numbers.h"
#include "gradsync/advise.h"
#include "gradsync/error.h"
#include "gradsync/version.h"
#include "json_writer.h"

namespace {

using gradsync::advise::Plan;
using gradsync::advise::Prediction;
using gradsync::advise::Profile;

constexpr const char* kUsage = R"(usage: gradsync-advise [flags]
       gradsync-advise --version

The configuration (gradsync-train's flags):
  --model mlp|cnn      (mlp: 784-2048x4-10)
  --layers FILE        the model as a JSON layer list (include/gradsync/advise.h)
  --hidden H1,H2,...   the MLP's hidden widths
  --batch N            samples per rank (64)
  --optimizer sgd|adam|adamw (sgd)
  --codec SPEC         (none)
  --bucket-mb MB       (25)        --first-bucket-mb MB (1)
  --accumulate K       (1)         --zero 0|1|2|3 (0)
  --no-overlap         all-reduce after backward
  --step-ahead 0|1     step-ahead error feedback, as gradsync-train's (1)
  --algo A             every all-reduce by that algorithm (ring, rd, hd, hier, shm), as
                       GRADSYNC_ALGO (or NCCL_ALGO=Ring) fixes it (default: as gradsync picks)
The cluster:
  --profile FILE       a hardware profile (profiles/*.json, or gradsync-probe's)
  --ranks N            (2)         --hosts H (1)
  --link-gbps G        bandwidth between hosts, 1e9 B/s (overrides the profile's)
  --latency-us U       latency between hosts (overrides the profile's)
  --cores-per-host C   (overrides the profile's)
Collectives alone:
  --collective NAME    allreduce, reduce_scatter or allgather: its predicted time, algorithm
                       and bus bandwidth (as nccl-tests reports it) from 4 KiB to 1 GiB, on
                       the cluster, instead of a training step
  --bytes B            that size alone
A run to explain:
  --trace FILE         a GRADSYNC_TIMELINE trace of gradsync-train: the measured breakdown
                       per step and bucket, and stragglers (with --profile, the prediction
                       beside it; --ranks defaults to the trace's)
Output:
  --json FILE          the prediction and the recommendations as JSON
  --plot FILE.png      the predicted breakdown of the plan and each change (needs gnuplot)
  --confirm STEPS      run the plan and the top three changes with gradsync-train for STEPS
                       steps each, and print predicted against measured: on this host, or
                       with --hosts H on H hosts through
  --launcher CMD       a command that runs what follows it on host {host} ("ssh node{host}",
                       "scripts/netns-cluster.sh exec --prefix P {host}"); the tools must
                       have the same paths there, and rank 0's host be this one
  --master-addr A      host 0's address     --master-port P (29650; each run the next)
)";

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "gradsync-advise: %s\n\n%s", message.c_str(), kUsage);
  std::exit(2);
}

struct Flags {
  std::string model = "mlp", hidden, optimizer = "sgd", profile, json;
  std::string layers;      // a workload file, in place of --model
  std::string trace;       // a GRADSYNC_TIMELINE trace of a run
  std::string plot;        // a PNG to draw
  std::string collective;  // a collective to tabulate, instead of a training step
  std::size_t bytes = 0;   // its one size; 0: 4 KiB to 1 GiB
  bool model_given = false, batch_given = false, optimizer_given = false, ranks_given = false;
  std::size_t batch = 64;
  Plan plan;
  double link_gbps = 0, latency_us = -1;
  int cores_per_host = 0;
  int confirm_steps = 0;              // run the plan and the top three changes for this many steps
  std::string launcher, master_addr;  // --confirm across hosts
  int master_port = 29650;
};

Flags parse(int argc, char** argv) {
  namespace f = gradsync::flags;
  Flags out;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (flag == "--version") {
      std::printf("gradsync-advise %s\n", gradsync::version());
      std::exit(0);
    }
    if (flag == "--no-overlap") {
      out.plan.overlap = false;
      continue;
    }
    if (i + 1 >= argc) usage_error(flag + " needs a value (or is unknown)");
    const std::string v = argv[++i];
    if (flag == "--model")
      out.model = v, out.model_given = true;
    else if (flag == "--layers")
      out.layers = v;
    else if (flag == "--hidden")
      out.hidden = v;
    else if (flag == "--optimizer")
      out.optimizer = v, out.optimizer_given = true;
    else if (flag == "--codec")
      out.plan.codec = v;
    else if (flag == "--profile")
      out.profile = v;
    else if (flag == "--json")
      out.json = v;
    else if (flag == "--batch")
      out.batch = static_cast<std::size_t>(f::integer(flag, v, 1, 1 << 24, usage_error)),
      out.batch_given = true;
    else if (flag == "--bucket-mb")
      out.plan.bucket_mb = f::number(flag, v, 0, 1 << 16, true, usage_error);
    else if (flag == "--first-bucket-mb")
      out.plan.first_bucket_mb = f::number(flag, v, 0, 1 << 16, true, usage_error);
    else if (flag == "--accumulate")
      out.plan.accumulate = static_cast<int>(f::integer(flag, v, 1, 1 << 16, usage_error));
    else if (flag == "--zero")
      out.plan.zero = static_cast<int>(f::integer(flag, v, 0, 3, usage_error));
    else if (flag == "--step-ahead")
      out.plan.step_ahead = f::integer(flag, v, 0, 1, usage_error) == 1;
    else if (flag == "--ranks")
      out.plan.ranks = static_cast<int>(f::integer(flag, v, 1, 1 << 20, usage_error)),
      out.ranks_given = true;
    else if (flag == "--trace")
      out.trace = v;
    else if (flag == "--plot")
      out.plot = v;
    else if (flag == "--collective")
      out.collective = v;
    else if (flag == "--algo") {
      const auto a = gradsync::parse_algorithm(v);
      if (!a) usage_error("--algo: unknown algorithm '" + v + "'");
      out.plan.algorithm = *a;
    } else if (flag == "--bytes")
      out.bytes = static_cast<std::size_t>(f::integer(flag, v, 4, 1LL << 40, usage_error));
    else if (flag == "--confirm")
      out.confirm_steps = static_cast<int>(f::integer(flag, v, 3, 100000, usage_error));
    else if (flag == "--launcher")
      out.launcher = v;
    else if (flag == "--master-addr")
      out.master_addr = v;
    else if (flag == "--master-port")
      out.master_port = static_cast<int>(f::integer(flag, v, 1024, 65000, usage_error));
    else if (flag == "--hosts")
      out.plan.hosts = static_cast<int>(f::integer(flag, v, 1, 1 << 20, usage_error));
    else if (flag == "--link-gbps")
      out.link_gbps = f::number(flag, v, 0, 1e6, true, usage_error);
    else if (flag == "--latency-us")
      out.latency_us = f::number(flag, v, 0, 1e7, false, usage_error);
    else if (flag == "--cores-per-host")
      out.cores_per_host = static_cast<int>(f::integer(flag, v, 1, 1 << 16, usage_error));
    else
      usage_error("unknown flag " + flag);
  }
  if (out.profile.empty() && out.trace.empty()) {
    usage_error("--profile FILE (see gradsync-probe) or --trace FILE is needed");
  }
  if (!out.layers.empty() && (out.model_given || !out.hidden.empty())) {
    usage_error("--layers FILE or --model, not both");
  }
  if (!out.collective.empty() &&
      (out.profile.empty() || !out.trace.empty() || out.confirm_steps > 0 || !out.plot.empty())) {
    usage_error("--collective needs --profile, and goes without --trace, --confirm and --plot");
  }
  if (!out.collective.empty() && out.collective != "allreduce" &&
      out.collective != "reduce_scatter" && out.collective != "allgather") {
    usage_error("--collective: '" + out.collective +
                "' is not allreduce, reduce_scatter or allgather");
  }
  if (out.bytes > 0 && out.collective.empty()) usage_error("--bytes goes with --collective");
  if (out.confirm_steps > 0 && !out.layers.empty()) {
    usage_error("--confirm runs gradsync-train's own models: not with --layers");
  }
  if (out.confirm_steps > 0 && out.plan.hosts > 1 &&
      (out.launcher.find("{host}") == std::string::npos || out.master_addr.empty())) {
    usage_error("--confirm on several hosts needs --launcher CMD (with {host}) and --master-addr");
  }
  if (!out.hidden.empty()) {
    if (out.model != "mlp") usage_error("--hidden is for --model mlp");
    out.model = "mlp:" + out.hidden;
  }
  return out;
}

std::string ms(double s) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f ms", s * 1e3);
  return text;
}

void print_breakdown(const Prediction& p) {
  std::printf(
      "predicted step %s: compute %s, communication %s (%s exposed, codec %s), "
      "optimizer %s; %.1f MiB a rank (parameters, gradients, optimizer state); "
      "%.1f MiB sent a rank per step\n",
      ms(p.step_s).c_str(), ms(p.compute_s).c_str(), ms(p.comm_s).c_str(),
      ms(p.exposed_comm_s).c_str(), ms(p.codec_s).c_str(), ms(p.optimizer_s).c_str(),
      p.memory_per_rank_bytes / 1048576.0, p.wire_bytes_per_rank / 1048576.0);
}

void write_prediction(gradsync::json::Writer& w, const Prediction& p) {
  w.begin_object()
      .field("step_s", p.step_s)
      .field("compute_s", p.compute_s)
      .field("comm_s", p.comm_s)
      .field("exposed_comm_s", p.exposed_comm_s)
      .field("codec_s", p.codec_s)
      .field("optimizer_s", p.optimizer_s)
      .field("wire_bytes_per_rank", p.wire_bytes_per_rank)
      .field("buckets", p.buckets.size())
      .end_object();
}

}  // namespace

void print_trace(const std::string& path, const gradsync::advise::TraceReport& t) {
  const auto& m = t.median;
  std::printf(
      "measured (%s, %s, %d ranks, %zu steps, the slowest rank's, median): step %s: "
      "compute %s, communication %s (%s waited for after backward), packing %s, "
      "%s %s\n",
      path.c_str(), t.pytorch ? "PyTorch" : "gradsync-train", t.ranks, t.steps,
      ms(m.step_s).c_str(), ms(m.compute_s).c_str(), ms(m.comm_s).c_str(),
      ms(m.exposed_comm_s).c_str(), ms(m.pack_s).c_str(),
      t.pytorch ? "optimizer and the rest until the next forward" : "optimizer",
      ms(m.optimizer_s).c_str());
  std::printf("buckets (median all-reduce):");
  for (std::size_t b = 0; b < t.bucket_s.size(); ++b) {
    std::printf(" #%zu %s", b, ms(t.bucket_s[b]).c_str());
  }
  std::printf("\n");
  if (t.stragglers.empty()) std::printf("stragglers: none\n");
  for (const auto& s : t.stragglers) std::printf("straggler: %s\n", s.c_str());
}

// Stacked bars, one per candidate (the plan first): compute, the communication not hidden
// behind it, the optimizer, per sample-equivalent step (accumulation's steps divided by K).
// gnuplot draws them; false (after saying why) if it cannot.
bool plot(const std::string& png, const Plan& plan, const Prediction& now,
          const std::vector<gradsync::advise::Recommendation>& changes) {
  const std::string data = png + ".dat";
  {
    std::ofstream out(data);
    auto row = [&](const std::string& label, const Prediction& p, int accumulate) {
      const double k = 1e3 / accumulate;
      out << '"' << label << "\" " << p.compute_s * k << ' ' << p.exposed_comm_s * k << ' '
          << p.optimizer_s * k << '\n';
    };
    row("now", now, plan.accumulate);
    for (const auto& r : changes) row(r.knob + "=" + r.proposed, r.predicted, r.plan.accumulate);
    if (!out) {
      std::fprintf(stderr, "gradsync-advise: %s\n", gradsync::flags::cannot_write(data).c_str());
      return false;
    }
  }
  const std::string script =
      "set terminal pngcairo size 1000,500; set output '" + png +
      "'; set style data histograms; set style histogram rowstacked; set style fill solid "
      "border -1; set boxwidth 0.7; set xtics rotate by -30; set ylabel 'ms per micro-batch "
      "step'; set key outside; set title 'gradsync-advise: predicted step by candidate'; plot '" +
      data +
      "' using 2:xtic(1) title 'compute', '' using 3 title 'exposed communication', "
      "'' using 4 title 'optimizer'";
  const std::string command = "gnuplot -e \"" + script + "\"";
  const int status = std::system(command.c_str());
  std::remove(data.c_str());
  if (status != 0) {
    std::fprintf(stderr,
                 "gradsync-advise: gnuplot could not draw %s (exit %d; "
                 "scripts/install-deps.sh installs gnuplot-nox)\n",
                 png.c_str(), status);
    return false;
  }
  return true;
}

// Ends a --json file: 0, or 1 after saying it could not be written.
int finish_json(std::ofstream& out, const std::string& path) {
  out << "\n";
  if (out) return 0;
  std::fprintf(stderr, "gradsync-advise: %s\n", gradsync::flags::cannot_write(path).c_str());
  return 1;
}

// The collective's predicted time and bus bandwidth from 4 KiB to 1 GiB, as nccl-tests
// prints its measurements; and as JSON.
int tabulate(const Flags& flags, const Profile& profile) {
  const auto& plan = flags.plan;
  std::printf("%s, %d ranks on %d hosts (%s), float32, predicted\n", flags.collective.c_str(),
              plan.ranks, plan.hosts, profile.name.c_str());
  std::printf("%12s %12s %12s %12s  %s\n", "bytes", "time (us)", "algbw (GB/s)", "busbw (GB/s)",
              "algorithm");
  std::vector<std::pair<std::size_t, gradsync::advise::CollectivePrediction>> rows;
  std::vector<std::size_t> sizes;
  for (std::size_t bytes = 4096; bytes <= (std::size_t{1} << 30); bytes *= 4)
    sizes.push_back(bytes);
  if (flags.bytes > 0) sizes = {flags.bytes};
  for (const std::size_t bytes : sizes) {
    const auto c = gradsync::advise::predict_collective(profile, flags.collective, plan.ranks,
                                                        plan.hosts, bytes, plan.algorithm);
    std::printf("%12zu %12.1f %12.2f %12.2f  %s\n", bytes, c.us, c.algbw_gbps, c.busbw_gbps,
                c.algorithm.c_str());
    rows.emplace_back(bytes, c);
  }
  if (flags.json.empty()) return 0;
  std::ofstream out(flags.json);
  gradsync::json::Writer w(out);
  w.begin_object()
      .field("collective", flags.collective)
      .field("ranks", plan.ranks)
      .field("hosts", plan.hosts)
      .field("profile", profile.name);
  w.key("sizes").begin_array();
  for (const auto& [bytes, c] : rows) {
    w.begin_object()
        .field("bytes", bytes)
        .field("us", c.us)
        .field("algbw_gbps", c.algbw_gbps)
        .field("busbw_gbps", c.busbw_gbps)
        .field("algorithm", c.algorithm)
        .end_object();
  }
  w.end_array().end_object();
  return finish_json(out, flags.json);
}

// Where gradsync-run and gradsync-train are: beside this program (an install's bin/), or in
// the build tree's tools/ and examples/.
std::string sibling(const std::string& name) {
  char self[4096] = {};
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  const std::string dir = n > 0 ? std::string(self, static_cast<std::size_t>(n)) : "";
  const std::string here = dir.substr(0, dir.rfind('/'));
  for (const std::string& candidate :
       {here + "/" + name, here + "/../examples/" + name, here + "/../tools/" + name}) {
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return name;  // from PATH
}

// gradsync-train's flags for `plan` on the trainer's model `model` ("mlp", "mlp:H,..", "cnn").
std::string train_flags(const std::string& model, const gradsync::advise::Workload& w,
                        const Plan& p) {
  std::ostringstream o;
  const auto colon = model.find(':');
  o << " --model " << model.substr(0, colon);
  if (colon != std::string::npos) o << " --hidden " << model.substr(colon + 1);
  o << " --batch " << w.batch << " --optimizer " << w.optimizer << " --codec '" << p.codec
    << "' --bucket-mb " << p.bucket_mb << " --first-bucket-mb " << p.first_bucket_mb
    << " --accumulate " << p.accumulate << " --zero " << p.zero << " --step-ahead "
    << (p.step_ahead ? 1 : 0) << (p.overlap ? "" : " --no-overlap");
  return o.str();
}

// `launcher` with {host} replaced by `host`.
std::string on_host(const std::string& launcher, int host) {
  std::string out = launcher;
  for (auto at = out.find("{host}"); at != std::string::npos; at = out.find("{host}")) {
    out.replace(at, 6, std::to_string(host));
  }
  return out;
}

// Runs `plan` for `steps` steps under GRADSYNC_TIMELINE and returns its measured median step
// (read_trace); negative if the run failed. On several hosts, one gradsync-run per host
// through the launcher, all at once; rank 0 gathers the timeline on host 0.
double measure(const Flags& flags, const gradsync::advise::Workload& w, const Plan& plan, int run) {
  char dir[] = "/tmp/gradsync-advise.XXXXXX";
  if (!::mkdtemp(dir)) return -1;
  const std::string trace = std::string(dir) + "/trace.json";
  const std::string train = sibling("gradsync-train") + train_flags(flags.model, w, plan) +
                            " --quiet --max-steps " + std::to_string(flags.confirm_steps + 3);
  const std::string algo =
      plan.algorithm == gradsync::Algorithm::kAuto
          ? ""
          : std::string(" GRADSYNC_ALGO=") + gradsync::to_string(plan.algorithm);
  std::string command;
  if (plan.hosts == 1) {
    command = "GRADSYNC_TIMELINE=" + trace + algo + " " + sibling("gradsync-run") + " -n " +
              std::to_string(plan.ranks) + " -- " + train + " > " + dir + "/log 2>&1";
  } else {
    // Every host's run in the background, then each one's exit status.
    std::string waits = "status=0";
    for (int h = 0; h < plan.hosts; ++h) {
      command += on_host(flags.launcher, h) + " env GRADSYNC_TIMELINE=" + trace + algo + " " +
                 sibling("gradsync-run") + " --nnodes " + std::to_string(plan.hosts) +
                 " --node-rank " + std::to_string(h) + " -n " +
                 std::to_string(plan.ranks / plan.hosts) + " --master-addr " + flags.master_addr +
                 " --master-port " + std::to_string(flags.master_port + run) + " -- " + train +
                 " > " + dir + "/log" + std::to_string(h) + " 2>&1 & p" + std::to_string(h) +
                 "=$!; ";
      waits += "; wait $p" + std::to_string(h) + " || status=1";
    }
    command += waits + "; exit $status";  // std::system's shell runs it
  }
  double step = -1;
  if (std::system(command.c_str()) == 0) step = gradsync::advise::read_trace(trace).median.step_s;
  std::filesystem::remove_all(dir);
  return step;
}

void confirm(const Flags& flags, const gradsync::advise::Workload& w, const Prediction& now,
             const std::vector<gradsync::advise::Recommendation>& changes) {
  std::printf(
      "\nconfirmed on %s (gradsync-train, %d steps each, median):\n",
      flags.plan.hosts == 1 ? "this host" : (std::to_string(flags.plan.hosts) + " hosts").c_str(),
      flags.confirm_steps);
  std::printf("%-34s %12s %12s %8s\n", "candidate", "predicted", "measured", "error");
  int run = 0;
  auto row = [&](const std::string& label, const Plan& plan, const Prediction& p) {
    const double measured = measure(flags, w, plan, run++);
    if (measured <= 0) {
      std::printf("%-34s %12s %12s\n", label.c_str(), ms(p.step_s).c_str(), "(run failed)");
      return;
    }
    std::printf("%-34s %12s %12s %+7.1f%%\n", label.c_str(), ms(p.step_s).c_str(),
                ms(measured).c_str(), 100 * (p.step_s / measured - 1));
  };
  row("now", flags.plan, now);
  for (std::size_t i = 0; i < changes.size() && i < 3; ++i) {
    const auto& r = changes[i];
    row(r.knob + "=" + r.proposed, r.plan, r.predicted);
  }
}

int main(int argc, char** argv) {
  Flags flags = parse(argc, argv);
  try {
    std::optional<gradsync::advise::TraceReport> trace;
    if (!flags.trace.empty()) {
      trace = gradsync::advise::read_trace(flags.trace);
      print_trace(flags.trace, *trace);
      if (!flags.ranks_given) flags.plan.ranks = trace->ranks;
      if (flags.profile.empty()) return 0;
      std::printf("\n");
    }
    Profile profile = gradsync::advise::load_profile(flags.profile);
    if (flags.link_gbps > 0) profile.inter.bandwidth_gbps = flags.link_gbps;
    if (flags.latency_us >= 0) profile.inter.alpha_us = flags.latency_us;
    if (flags.cores_per_host > 0) profile.cores_per_host = flags.cores_per_host;
    if (!flags.collective.empty()) return tabulate(flags, profile);
    auto workload = flags.layers.empty() ? gradsync::advise::model_workload(
                                               flags.model, flags.batch, flags.optimizer)
                                         : gradsync::advise::load_workload(flags.layers);
    if (!flags.layers.empty()) {  // the flags given override the file's
      if (flags.batch_given) workload.batch = flags.batch;
      if (flags.optimizer_given) workload.optimizer = flags.optimizer;
    }
    const Prediction now = gradsync::advise::predict(profile, workload, flags.plan);
    const auto changes = gradsync::advise::recommend(profile, workload, flags.plan);

    std::printf("%s, %zu parameters, batch %zu, %d ranks on %d hosts (%s)\n", workload.name.c_str(),
                workload.parameters(), workload.batch, flags.plan.ranks, flags.plan.hosts,
                profile.name.c_str());
    std::printf("bottleneck: %s\n", now.explanation.c_str());
    print_breakdown(now);
    for (const auto& pitfall : now.pitfalls) std::printf("pitfall: %s\n", pitfall.c_str());
    if (changes.empty()) {
      std::printf("no single change is predicted to make a sample faster\n");
    } else {
      std::printf("\n%-16s %-18s %-18s %12s %8s  %s | %s\n", "knob", "now", "proposed", "step",
                  "change", "why", "risk");
      for (const auto& r : changes) {
        std::printf("%-16s %-18s %-18s %12s %+7.1f%%  %s | %s\n", r.knob.c_str(), r.now.c_str(),
                    r.proposed.c_str(), ms(r.predicted.step_s).c_str(), 100 * r.change,
                    r.why.c_str(), r.risk.c_str());
      }
      std::printf("(change: time per sample; accumulation puts more samples in a step)\n");
    }
    if (!flags.plot.empty() && !plot(flags.plot, flags.plan, now, changes)) return 1;
    if (flags.confirm_steps > 0) confirm(flags, workload, now, changes);
    if (!flags.json.empty()) {
      std::ofstream out(flags.json);
      gradsync::json::Writer w(out);
      w.begin_object()
          .field("model", workload.name)
          .field("ranks", flags.plan.ranks)
          .field("hosts", flags.plan.hosts)
          .field("profile", profile.name)
          .field("bottleneck", now.bottleneck)
          .field("explanation", now.explanation)
          .field("memory_per_rank_bytes", now.memory_per_rank_bytes);
      w.field("pitfalls", now.pitfalls);
      if (trace) {
        const auto& m = trace->median;
        w.key("measured")
            .begin_object()
            .field("trace", flags.trace)
            .field("steps", trace->steps)
            .field("step_s", m.step_s)
            .field("compute_s", m.compute_s)
            .field("comm_s", m.comm_s)
            .field("exposed_comm_s", m.exposed_comm_s)
            .field("pack_s", m.pack_s)
            .field("optimizer_s", m.optimizer_s)
            .field("bucket_s", trace->bucket_s)
            .field("stragglers", trace->stragglers)
            .end_object();
      }
      w.key("predicted");
      write_prediction(w, now);
      w.key("recommendations").begin_array();
      for (const auto& r : changes) {
        w.begin_object()
            .field("knob", r.knob)
            .field("now", r.now)
            .field("proposed", r.proposed)
            .field("change", r.change)
            .field("why", r.why)
            .field("risk", r.risk);
        w.key("predicted");
        write_prediction(w, r.predicted);
        w.end_object();
      }
      w.end_array().end_object();
      if (finish_json(out, flags.json) != 0) return 1;
    }
  } catch (const gradsync::Error& e) {
    std::fprintf(stderr, "gradsync-advise: %s\n", e.what());
    return 2;
  }
  return 0;
}
