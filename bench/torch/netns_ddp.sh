#!/usr/bin/env bash
# The DDP step across "hosts" joined by shaped links: bench/torch/ddp_step.py with one rank per
# network namespace (scripts/netns-cluster.sh, tc tbf at --rate), started by one gradsync-run
# per host as on separate machines, gloo and gradsync alternating in every repetition, each
# hook in turn. Prints the slowest rank's median step per backend and hook, median over the
# repetitions. Needs root. Holds /tmp/gradsync-bench.lock, as the other benchmarks do.
#
#   bench/torch/netns_ddp.sh [--hosts 2] [--rate 1gbit] [--repeats 3] [--steps 12]
#                            [--hooks "none gradsync:bf16"] [--build build]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
hosts=2
rate=1gbit
repeats=3
steps=12
hooks="none gradsync:bf16"
build=build
while [[ $# -gt 0 ]]; do
  case "$1" in
    --hosts) hosts=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --repeats) repeats=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --hooks) hooks=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    *) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done
[[ $build = /* ]] || build=$root/$build
cluster=$root/scripts/netns-cluster.sh
prefix=gt
results=$(mktemp -d /tmp/netns_ddp.XXXXXX)
trap '"$cluster" down --prefix $prefix >/dev/null; rm -rf "$results"' EXIT
exec 9>/tmp/gradsync-bench.lock
flock -n 9 || { echo "netns_ddp: waiting for /tmp/gradsync-bench.lock" >&2; flock 9; }
"$cluster" up --prefix $prefix --hosts "$hosts" --rate "$rate" >/dev/null
master=$("$cluster" addr --prefix $prefix 0)
export PYTHONPATH=$root/$(basename "$build")/python${PYTHONPATH:+:$PYTHONPATH}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
port=29700
for ((rep = 0; rep < repeats; rep++)); do
  for hook in $hooks; do
    for backend in gloo gradsync; do
      [[ $backend = gloo && $hook = gradsync:* ]] && continue
      name="$backend~${hook//:/_}~$rep"
      port=$((port + 1))
      echo "netns_ddp: repetition $((rep + 1))/$repeats, $backend, hook $hook" >&2
      pids=()
      for ((h = 0; h < hosts; h++)); do
        "$cluster" exec --prefix $prefix "$h" env GRADSYNC_TIMEOUT=120000 GLOO_SOCKET_IFNAME=eth0 \
          "$build/tools/gradsync-run" --nnodes "$hosts" --node-rank "$h" -n 1 \
          --master-addr "$master" --master-port $port --timeout-s 300 --no-prefix -- \
          /usr/bin/python3 "$root/bench/torch/ddp_step.py" --backend "$backend" --hook "$hook" \
          --steps "$steps" --warmup 3 --json "$results/$name.json" >"$results/$name.h$h.log" 2>&1 &
        pids+=($!)
      done
      for p in "${pids[@]}"; do wait "$p" || { tail -n 5 "$results/$name".h*.log >&2; exit 1; }; done
    done
  done
done
/usr/bin/python3 - "$results" "$rate" "$hosts" <<'PY'
import glob, json, os, statistics, sys
results, rate, hosts = sys.argv[1:]
steps = {}
for f in glob.glob(os.path.join(results, "*.json")):
    backend, hook, _ = os.path.basename(f)[:-5].split("~")
    steps.setdefault((backend, hook), []).append(json.load(open(f))["step_s"] * 1e3)
gloo = statistics.median(steps[("gloo", "none")])
print(f"DDP step, {hosts} hosts at {rate}, median of the slowest rank's median step (ms), range")
print(f"{'backend':<10}{'hook':<16}{'step_ms':>10}{'range':>18}{'gloo_none/this':>16}")
for (backend, hook), v in sorted(steps.items()):
    m = statistics.median(v)
    print(f"{backend:<10}{hook:<16}{m:>10.1f}{f'{min(v):.1f}-{max(v):.1f}':>18}{gloo / m:>16.2f}")
PY
