#!/usr/bin/env bash
# What gradient accumulation and ZeRO save, counted by gradsync-train itself (--json), not
# timed: all-reduce calls and bytes each rank sent per micro-batch and per optimizer step with
# --accumulate 1 and K (over loopback TCP, whose transport counts every byte; shared memory
# is not counted), and per-rank optimizer-state and reduced-gradient memory with --zero 0, 1,
# 2 at each world size. The 14.2 M-parameter MLP, a few steps each. Holds
# /tmp/gradsync-bench.lock.
#
#   bench/train/accumulate_zero.sh [--build DIR] [--ranks "1 2 4"] [--accumulate 4]
#                                  [--optimizer adamw] [--steps 8]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=build
ranks="1 2 4"
accumulate=4
optimizer=adamw
steps=8
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    --accumulate) accumulate=$2; shift 2 ;;
    --optimizer) optimizer=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    *) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done
[[ $build = /* ]] || build=$root/$build
results=$(mktemp -d /tmp/accumulate_zero.XXXXXX)
trap 'rm -rf "$results"' EXIT
exec 9>/tmp/gradsync-bench.lock
flock 9
train() {  # ranks name args...
  local n=$1 name=$2
  shift 2
  "$build/tools/gradsync-run" -n "$n" --no-prefix -- "$build/examples/gradsync-train" \
    --model mlp --max-steps "$steps" --quiet --optimizer "$optimizer" --json "$results/$name.json" "$@" \
    >/dev/null 2>&1 || echo "accumulate_zero: $name failed" >&2
}
last=${ranks##* }
for k in 1 "$accumulate"; do
  echo "accumulate_zero: $last ranks, --accumulate $k" >&2
  GRADSYNC_TRANSPORT=tcp train "$last" "acc~$last~$k" --accumulate "$k"
done
for n in $ranks; do
  for z in 0 1 2; do
    echo "accumulate_zero: $n ranks, --zero $z" >&2
    train "$n" "zero~$n~$z" --zero "$z"
  done
done
python3 - "$results" "$steps" <<'PY'
import glob, json, os, sys
results, steps = sys.argv[1], int(sys.argv[2])
runs = {}
for path in glob.glob(os.path.join(results, "*.json")):
    runs[os.path.basename(path)[:-5]] = json.load(open(path))
acc = sorted((k for k in runs if k.startswith("acc~")), key=lambda k: int(k.split("~")[2]))
if acc:
    print(f"Accumulation, {acc[0].split('~')[1]} ranks over loopback TCP, {steps} optimizer steps:\n")
    print("| --accumulate | all-reduce calls per optimizer step | per micro-batch | "
          "bytes sent per rank per optimizer step | per micro-batch |")
    print("|---:|---:|---:|---:|---:|")
    for k in acc:
        d = runs[k]
        micro = d["config"]["accumulate"]
        calls, sent = d["allreduce_calls"] / d["steps"], d["bytes_sent_per_rank"] / d["steps"]
        print(f"| {micro} | {calls:.1f} | {calls / micro:.2f} | {sent / 1e6:.1f} MB | "
              f"{sent / micro / 1e6:.1f} MB |")
    print()
print("ZeRO, per-rank memory (MB):\n")
print("| ranks | --zero | optimizer state | reduced gradient | state vs stage 0 |")
print("|---:|---:|---:|---:|---:|")
for k in sorted((k for k in runs if k.startswith("zero~")), key=lambda k: tuple(map(int, k.split("~")[1:]))):
    _, n, z = k.split("~")
    d, base = runs[k], runs.get(f"zero~{n}~0")
    ratio = d["optimizer_state_bytes_per_rank"] / base["optimizer_state_bytes_per_rank"] if base else float("nan")
    print(f"| {n} | {z} | {d['optimizer_state_bytes_per_rank'] / 1e6:.1f} | "
          f"{d['reduced_gradient_bytes_per_rank'] / 1e6:.1f} | {ratio:.2f} |")
PY
