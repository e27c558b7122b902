#!/usr/bin/env bash
# DDP against ZeRO 1, 2 and 3 in gradsync-train, as each run counts itself (--json): bytes each
# rank sent per step against the theory (a ring all-reduce sends 2(N-1)/N of the parameters'
# bytes, a reduce-scatter or an all-gather (N-1)/N), memory per rank (parameters, gradients,
# optimizer state kept between steps; the buffers ZeRO gathers into as layers run; peak
# RSS), the median step time, and how much of ZeRO's all-gather time the step waited
# for, with AdamW; and OUT.png, memory per rank and step time side by side. Ranks talk over TCP
# (GRADSYNC_TRANSPORT=tcp) so that every byte is counted; with --hosts H, over H namespace
# hosts of scripts/netns-cluster.sh linked at --rate (root). Repeats alternate the
# strategies. Holds /tmp/gradsync-bench.lock.
#
#   bench/train/strategies.sh [--build DIR] [--ranks 4] [--hosts 1] [--rate 1gbit]
#                             [--steps 12] [--repeats 3] [--hidden 2048,2048,2048,2048]
#                             [--batch 64] [--strategies "ddp zero1 zero2 zero3"]
#                             [--out bench/train/strategies.png] [--transport tcp]
#                             [--train-args "--codec int8"]
# --transport shm (one host) runs on gradsync's default there: its bytes through the shared
# arena go uncounted, so the bytes columns then say nothing. --train-args go to every run (the
# theory column assumes float32 on the wire).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=build
ranks=4
hosts=1
rate=1gbit
steps=12
repeats=3
hidden=2048,2048,2048,2048
batch=64
strategies="ddp zero1 zero2 zero3"
out=$here/strategies.png
transport=tcp
train_args=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    --hosts) hosts=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --repeats) repeats=$2; shift 2 ;;
    --hidden) hidden=$2; shift 2 ;;
    --batch) batch=$2; shift 2 ;;
    --strategies) strategies=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --transport) transport=$2; shift 2 ;;
    --train-args) train_args=$2; shift 2 ;;
    *) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done
[[ $build = /* ]] || build=$root/$build
results=$(mktemp -d /tmp/strategies.XXXXXX)
cluster=$root/scripts/netns-cluster.sh
cleanup() {
  rm -rf "$results"
  if ((hosts > 1)); then "$cluster" down --prefix gs >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
exec 9>/tmp/gradsync-bench.lock
flock 9
if ((hosts > 1)); then
  "$cluster" up --prefix gs --hosts "$hosts" --rate "$rate" >/dev/null
  master=$("$cluster" addr --prefix gs 0)
fi
port=29870
train() {  # strategy repeat
  local name="$1~$2" args=(--model mlp --hidden "$hidden" --optimizer adamw --strategy "$1"
    --batch "$batch" --max-steps "$steps" --quiet $train_args)
  port=$((port + 1))
  if ((hosts == 1)); then
    GRADSYNC_TRANSPORT=$transport "$build/tools/gradsync-run" -n "$ranks" --no-prefix -- \
      "$build/examples/gradsync-train" "${args[@]}" --json "$results/$name.json" >/dev/null 2>&1 ||
      echo "strategies: $name failed" >&2
    return
  fi
  local pids=()
  for ((h = 0; h < hosts; h++)); do
    "$cluster" exec --prefix gs "$h" env GRADSYNC_TRANSPORT=tcp "$build/tools/gradsync-run" \
      --nnodes "$hosts" --node-rank "$h" -n $((ranks / hosts)) --master-addr "$master" \
      --master-port "$port" --no-prefix -- "$build/examples/gradsync-train" "${args[@]}" \
      --json "$results/$name.json" >/dev/null 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || echo "strategies: $name failed" >&2; done
}
for ((r = 0; r < repeats; r++)); do
  for s in $strategies; do
    echo "strategies: $s, repeat $((r + 1)) of $repeats ($ranks ranks, $hosts hosts)" >&2
    train "$s" "$r"
  done
done
python3 - "$results" "$ranks" "$results/plot.dat" <<'PY'
import glob, json, os, re, statistics, sys
results, n, plot = sys.argv[1], int(sys.argv[2]), open(sys.argv[3], "w")
runs = {}
for path in glob.glob(os.path.join(results, "*.json")):
    s, _ = os.path.basename(path)[:-5].split("~")
    runs.setdefault(s, []).append(json.load(open(path)))
# x (N-1)/N of the parameters' bytes. ZeRO 1 and 2's first step gathers nothing (their
# parameters start whole) and their last step's gather is counted by no step: (2S-1)/S over S
# steps.
theory = {"ddp": 2, "zero1": 2, "zero2": 2, "zero3": 3}
base = base_memory = None
print("| strategy | bytes sent per rank per step | theory | parameters | gradients | "
      "optimizer state | kept vs DDP | gather buffers | peak RSS | step (median) | vs DDP | "
      "all-gather exposed |")
print("|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for s in ("ddp", "zero1", "zero2", "zero3"):
    if s not in runs:
        continue
    ds = runs[s]
    d = ds[0]
    whole = 4 * int(re.search(r"\((\d+)\)", d["config"]["model"]).group(1))
    sent = statistics.median(x["bytes_sent_per_rank"] / x["steps"] for x in ds)
    step = statistics.median(x["step_s"] for x in ds)
    base = base or step
    expect = theory[s] * (n - 1) / n * whole
    kept = sum(d[k] for k in ("parameter_bytes_per_rank", "gradient_bytes_per_rank",
                              "optimizer_state_bytes_per_rank"))
    base_memory = base_memory or kept
    gather = sum(x["gather_s_per_step"] for x in ds)
    exposed = (f"{sum(x['exposed_gather_s_per_step'] for x in ds) / gather:.0%}"
               if gather else "")
    mb = lambda b: f"{b / 1e6:.1f} MB"
    print(f"| {s} | {mb(sent)} | {mb(expect)} ({sent / expect:.3f}) | "
          f"{mb(d['parameter_bytes_per_rank'])} | {mb(d['gradient_bytes_per_rank'])} | "
          f"{mb(d['optimizer_state_bytes_per_rank'])} | {kept / base_memory:.2f} | "
          f"{mb(d.get('working_bytes_per_rank', 0))} | "
          f"{mb(statistics.median(x['peak_rss_bytes'] for x in ds))} | {1e3 * step:.1f} ms | "
          f"{step / base:.2f} | {exposed} |")
    # The plot's row: memory kept (three parts), gather buffers, step, in MB and ms.
    print(s, *(f"{d[k] / 1e6:.1f}" for k in ("parameter_bytes_per_rank", "gradient_bytes_per_rank",
                                            "optimizer_state_bytes_per_rank",
                                            "working_bytes_per_rank")),
          f"{1e3 * step:.1f}", file=plot)
PY
gnuplot -e "datafile='$results/plot.dat'; outfile='$out'; ranks=$ranks; hosts=$hosts" \
  "$here/strategies.gp"
