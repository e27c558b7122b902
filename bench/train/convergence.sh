#!/usr/bin/env bash
# Convergence on Fashion-MNIST per codec: gradsync-train with every codec in turn, the same
# model, seed, epochs and ranks; prints a markdown table (test accuracy, final loss, wall
# time, throughput) and plots the training curves of all
# runs into OUT.png (examples/train/plot_curves.sh). Holds /tmp/gradsync-bench.lock.
#
#   bench/train/convergence.sh [--build DIR] [--ranks 4] [--epochs 5] [--hidden 512,512]
#                              [--codecs "none fp16 ..."] [--out bench/train/convergence.png]
#                              [--lr X] [--seeds "1 2 3"] [--train-args "--lr-schedule cosine"]
# With several seeds (initialisation and data order) every codec runs once per seed; the
# table gives the mean test accuracy and its spread and the mean difference to none, a list
# below it the difference seed by seed, and the plot the first seed's curves. --train-args
# go to every gradsync-train run. A "codec" amp:bf16 or amp:fp16 is a mixed-precision run
# (--amp) instead.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=build
ranks=4
epochs=5
hidden=512,512
lr=0.05
seeds=1
out=$here/convergence.png
codecs="none fp16 bf16 int8 topk:ratio=0.01 topk:ratio=0.01,ef=0 topk:ratio=0.01,union=1 sign powersgd:rank=4"
train_args=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    --epochs) epochs=$2; shift 2 ;;
    --hidden) hidden=$2; shift 2 ;;
    --codecs) codecs=$2; shift 2 ;;
    --lr) lr=$2; shift 2 ;;
    --seeds) seeds=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --train-args) train_args=$2; shift 2 ;;
    *) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done
[[ $build = /* ]] || build=$root/$build
results=$(mktemp -d /tmp/convergence.XXXXXX)
trap 'rm -rf "$results"' EXIT
exec 9>/tmp/gradsync-bench.lock
flock 9
i=0
for codec in $codecs; do
  for seed in $seeds; do
    echo "convergence: $codec, seed $seed" >&2
    if [[ $codec == amp:* ]]; then how=(--amp "${codec#amp:}"); else how=(--codec "$codec"); fi
    "$build/tools/gradsync-run" -n "$ranks" --no-prefix -- "$build/examples/gradsync-train" \
      --model mlp --hidden "$hidden" --epochs "$epochs" --lr "$lr" --seed "$seed" --quiet \
      "${how[@]}" $train_args --json "$results/$i~$seed.json" >/dev/null 2>&1 ||
      echo "convergence: $codec seed $seed failed" >&2
  done
  i=$((i + 1))
done
python3 - "$results" "$ranks" "$epochs" "$hidden" "$lr" "$train_args" $seeds <<'PY'
import glob, json, os, statistics, sys
results, ranks, epochs, hidden, lr, train_args = sys.argv[1:7]
seeds = sys.argv[7:]
runs = {}
for p in glob.glob(os.path.join(results, "*.json")):
    i, seed = os.path.basename(p)[:-5].split("~")
    runs.setdefault(int(i), {})[seed] = json.load(open(p))
# Step-ahead error feedback (gradsync-train's default) changes every codec that holds back.
ahead = any(d["config"].get("step_ahead") for r in runs.values() for d in r.values())
print(f"{ranks} ranks, MLP 784-{hidden.replace(',', '-')}-10, batch 64 per rank, SGD momentum "
      f"0.9 lr {lr}, {epochs} epochs, seed{'s' if len(seeds) > 1 else ''} {', '.join(seeds)}"
      f"{', ' + train_args if train_args else ''}, step-ahead {'on' if ahead else 'off'}\n")
multi = len(seeds) > 1
print("| codec | test accuracy" + (" (mean, min-max)" if multi else "") +
      " | vs none (pp" + (", mean of the seeds" if multi else "") +
      ") | final loss | wall | samples/s | step | skipped steps |")
print("|:---|---:|---:|---:|---:|---:|---:|---:|")
def label(d):
    amp = d["config"].get("amp", "none")
    return f"--amp {amp} ({d['config']['codec']} gradients)" if amp != "none" else d["config"]["codec"]
base = runs.get(0, {})
for i in sorted(runs):
    by_seed = runs[i]
    accs = [100 * d["test_accuracy"] for d in by_seed.values()]
    diffs = [100 * (d["test_accuracy"] - base[s]["test_accuracy"]) for s, d in by_seed.items() if s in base]
    any_run = next(iter(by_seed.values()))
    acc = f"{statistics.mean(accs):.2f}%" + (f" ({min(accs):.2f}-{max(accs):.2f})" if multi else "")
    print(f"| {label(any_run)} | {acc} | {statistics.mean(diffs):+.2f} | "
          f"{statistics.mean(d['final_loss'] for d in by_seed.values()):.4f} | "
          f"{statistics.mean(d['wall_s'] for d in by_seed.values()):.1f} s | "
          f"{statistics.mean(d['samples_per_s'] for d in by_seed.values()):.0f} | "
          f"{1e3 * statistics.median(d['step_s'] for d in by_seed.values()):.2f} ms | "
          f"{sum(d.get('skipped_steps', 0) for d in by_seed.values())} |")
# Seed by seed, for paired comparisons later (the results directory is removed at exit).
if multi:
    print("\nvs none, seed by seed (pp):")
    for i in sorted(runs):
        by_seed = runs[i]
        cells = [f"{s} {100 * (by_seed[s]['test_accuracy'] - base[s]['test_accuracy']):+.2f}"
                 for s in seeds if s in by_seed and s in base]
        print(f"- {label(next(iter(by_seed.values())))}: " + ", ".join(cells))
PY
first=${seeds%% *}
plots=()
for ((j = 0; j < i; j++)); do [[ -f $results/$j~$first.json ]] && plots+=("$results/$j~$first.json"); done
bash "$root/examples/train/plot_curves.sh" "$out" "${plots[@]}"
