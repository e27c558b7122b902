#!/usr/bin/env bash
# PyTorch's own ZeRO 1 against its DDP on gradsync-train's MLP (784-2048x4-10, AdamW, batch 64
# per rank, gloo on CPU, one thread per rank): torch_zero_mlp.py under torchrun (Debian's
# torch 1.13, /usr/bin/python3), the strategies alternating within every repeat so that drift
# on the machine hits both; then a table of memory per rank (optimizer state of the fullest
# rank, parameters, gradients, peak RSS of the largest rank) and the median step over the
# repeats, next to bench/train/strategies.sh's for gradsync. Holds /tmp/gradsync-bench.lock.
#
#   bench/peers/torch_zero.sh [--ranks 4] [--steps 12] [--repeats 3] [--timeout 600]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../torch/torchrun.sh"  # torch_job: torchrun with the flags 1.13 needs
ranks=4
steps=12
repeats=3
timeout_s=600
while [[ $# -gt 0 ]]; do
  case "$1" in
    --ranks) ranks=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --repeats) repeats=$2; shift 2 ;;
    --timeout) timeout_s=$2; shift 2 ;;
    *) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done
results=$(mktemp -d /tmp/torch_zero.XXXXXX)
trap 'rm -rf "$results"' EXIT
export OMP_NUM_THREADS=1  # torch_zero_mlp.py sets one thread too; this covers its start-up
source "$here/torch_malloc.sh"
exec 9>/tmp/gradsync-bench.lock
flock 9
for ((r = 0; r < repeats; r++)); do
  for s in ddp zero1; do
    echo "torch_zero: $s, repeat $((r + 1)) of $repeats ($ranks ranks)" >&2
    torch_job "$results" "$timeout_s" "$s~$r" "$ranks" "$here/torch_zero_mlp.py" \
      --strategy "$s" --steps "$steps"
  done
done
/usr/bin/python3 - "$results" <<'PY'
import glob, json, os, statistics, sys
runs = {}
for path in glob.glob(os.path.join(sys.argv[1], "*.json")):
    runs.setdefault(os.path.basename(path).split("~")[0], []).append(json.load(open(path)))
mb = lambda b: f"{b / 1e6:.1f} MB"
print("| strategy | optimizer state per rank | parameters | gradients | peak RSS | "
      "step (median of repeats) | vs torch DDP |")
print("|:---|---:|---:|---:|---:|---:|---:|")
base = statistics.median(x["step_s"] for x in runs["ddp"]) if "ddp" in runs else None
for s in ("ddp", "zero1"):
    if s not in runs:
        continue
    ds, d = runs[s], runs[s][0]
    step = statistics.median(x["step_s"] for x in ds)
    ratio = f"{step / base:.2f}" if base else ""
    print(f"| torch {s} ({d['ranks']} ranks) | {mb(d['optimizer_state_bytes_per_rank'])} | "
          f"{mb(d['parameter_bytes_per_rank'])} | {mb(d['gradient_bytes_per_rank'])} | "
          f"{mb(statistics.median(x['peak_rss_bytes'] for x in ds))} | {1e3 * step:.1f} ms | "
          f"{ratio} |")
PY
