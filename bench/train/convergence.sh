#!/usr/bin/env bash
# Convergence on Fashion-MNIST per codec: gradsync-train with every codec in turn, the same
# model, seed, epochs and ranks; prints a markdown table (test accuracy, final loss, wall
# time, throughput) and plots the training curves of all
# runs into OUT.png (examples/train/plot_curves.sh). Holds /tmp/gradsync-bench.lock.
#
#   bench/train/convergence.sh [--build DIR] [--ranks 4] [--epochs 5] [--hidden 512,512]
#                              [--codecs "none fp16 ..."] [--out bench/train/convergence.png]
#                              [--lr X]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=build
ranks=4
epochs=5
hidden=512,512
lr=0.05
out=$here/convergence.png
codecs="none fp16 bf16 int8 topk:ratio=0.01 topk:ratio=0.01,ef=0 sign powersgd:rank=4"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    --epochs) epochs=$2; shift 2 ;;
    --hidden) hidden=$2; shift 2 ;;
    --codecs) codecs=$2; shift 2 ;;
    --lr) lr=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done
[[ $build = /* ]] || build=$root/$build
results=$(mktemp -d /tmp/convergence.XXXXXX)
trap 'rm -rf "$results"' EXIT
exec 9>/tmp/gradsync-bench.lock
flock 9
i=0
for codec in $codecs; do
  echo "convergence: $codec" >&2
  "$build/tools/gradsync-run" -n "$ranks" --no-prefix -- "$build/examples/gradsync-train" \
    --model mlp --hidden "$hidden" --epochs "$epochs" --lr "$lr" --seed 1 --quiet --codec "$codec" \
    --json "$results/$i.json" >/dev/null 2>&1 || echo "convergence: $codec failed" >&2
  i=$((i + 1))
done
python3 - "$results" "$ranks" "$epochs" "$hidden" "$lr" <<'PY'
import glob, json, os, sys
results, ranks, epochs, hidden, lr = sys.argv[1:6]
runs = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(results, "*.json")),
                                            key=lambda p: int(os.path.basename(p)[:-5]))]
base = runs[0]["test_accuracy"]
print(f"{ranks} ranks, MLP 784-{hidden.replace(',', '-')}-10, batch 64 per rank, SGD momentum "
      f"0.9 lr {lr}, seed 1, {epochs} epochs\n")
print("| codec | test accuracy | vs none (pp) | final loss | wall | samples/s |")
print("|:---|---:|---:|---:|---:|---:|")
for d in runs:
    acc = d["test_accuracy"]
    print(f"| {d['config']['codec']} | {100 * acc:.2f}% | {100 * (acc - base):+.2f} | "
          f"{d['final_loss']:.4f} | {d['wall_s']:.1f} s | {d['samples_per_s']:.0f} |")
PY
bash "$root/examples/train/plot_curves.sh" "$out" "$results"/*.json
