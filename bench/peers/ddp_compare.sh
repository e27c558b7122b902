#!/usr/bin/env bash
# gradsync-train against PyTorch DDP (Debian's python3-torch 1.13, gloo, one thread per
# rank) on the same MLP (784-2048x4-10, 14.2 M parameters) and batch (64 per rank): median
# step time, plain and with fp16 and PowerSGD (rank 4) compression, for each world size,
# the two alternating in every round; scaling efficiency = per-rank throughput at N ranks
# over the single-process throughput of the same program. Both launched by gradsync-run
# (torch reads the same RANK/WORLD_SIZE/MASTER_* variables). Holds /tmp/gradsync-bench.lock.
#
#   bench/peers/ddp_compare.sh [--build DIR] [--ranks "1 2 4"] [--steps 30] [--warmup 5]
#                              [--repeats 3] [--variants "none fp16 powersgd"]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=build
ranks="1 2 4"
steps=30
warmup=5
repeats=3
variants="none fp16 powersgd"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --repeats) repeats=$2; shift 2 ;;
    --variants) variants=$2; shift 2 ;;
    *) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done
[[ $build = /* ]] || build=$root/$build
results=$(mktemp -d /tmp/ddp_compare.XXXXXX)
trap 'rm -rf "$results"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
source "$here/torch_malloc.sh"

codec_of() {
  case "$1" in none) echo none ;; fp16) echo fp16 ;; powersgd) echo powersgd:rank=4 ;; esac
}

torch_run() {  # ranks variant rep
  "$build/tools/gradsync-run" -n "$1" --no-prefix -- /usr/bin/python3 "$here/torch_ddp_mlp.py" \
    --hook "$2" --steps "$steps" --warmup "$warmup" 2>/dev/null | grep '^{' >"$results/torch~$1~$2~$3.json" ||
    echo "ddp_compare: torch failed: $1 ranks, $2" >&2
}

# --step-ahead 0: torch's PowerSGD hook computes gradients where the model stands, so equal
# settings leave out gradsync's step-ahead error feedback (and its copy of the values).
gradsync_run() {  # ranks variant rep
  "$build/tools/gradsync-run" -n "$1" --no-prefix -- "$build/examples/gradsync-train" \
    --model mlp --max-steps $((steps + warmup)) --quiet --codec "$(codec_of "$2")" --step-ahead 0 \
    --json "$results/gradsync~$1~$2~$3.json" >/dev/null 2>&1 ||
    echo "ddp_compare: gradsync-train failed: $1 ranks, $2" >&2
}

exec 9>/tmp/gradsync-bench.lock
flock 9
for ((rep = 0; rep < repeats; rep++)); do
  for n in $ranks; do
    for v in $variants; do
      [[ $n == 1 && $v != none ]] && continue  # one process: nothing to compress
      echo "ddp_compare: repeat $((rep + 1))/$repeats, $n ranks, $v" >&2
      if ((rep % 2)); then gradsync_run "$n" "$v" "$rep"; torch_run "$n" "$v" "$rep"
      else torch_run "$n" "$v" "$rep"; gradsync_run "$n" "$v" "$rep"; fi
    done
  done
done
python3 - "$results" "$warmup" <<'PY'
import glob, json, os, statistics, sys
results, warmup = sys.argv[1], int(sys.argv[2])
runs = {}
for path in glob.glob(os.path.join(results, "*.json")):
    impl, n, v, rep = os.path.basename(path)[:-5].split("~")
    text = open(path).read().strip()
    if not text: continue
    d = json.loads(text.splitlines()[-1]) if impl == "torch" else json.load(open(path))
    if impl == "torch":
        step = d["step_s"]
    else:  # the median step after the warm-up, from the per-step wall times
        w = d["wall_at_step"]
        step = statistics.median(w[i] - w[i - 1] for i in range(warmup + 1, len(w)))
    runs.setdefault((impl, int(n), v), []).append(step)
med = {k: statistics.median(v) for k, v in runs.items()}
print("| ranks | gradients | PyTorch DDP step | gradsync step | gradsync speed-up | DDP efficiency | gradsync efficiency |")
print("|---:|:---|---:|---:|---:|---:|---:|")
for (impl, n, v) in sorted(k for k in med if k[0] == "torch"):
    t, g = med[("torch", n, v)], med.get(("gradsync", n, v))
    t1, g1 = med.get(("torch", 1, "none")), med.get(("gradsync", 1, "none"))
    if g is None: continue
    eff = lambda one, x: f"{one / x:.2f}" if one else "-"
    print(f"| {n} | {v} | {t * 1000:.0f} ms | {g * 1000:.0f} ms | {t / g:.2f}x | {eff(t1, t)} | {eff(g1, g)} |")
PY
