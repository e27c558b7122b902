#!/usr/bin/env bash
# Does compression or bf16 autocast cost accuracy? examples/torch/train.py on Fashion-MNIST
# over gradsync, for each configuration and seed, then a table of final test accuracies:
# mean over the seeds, and the difference from float32 without a hook
# (bench/torch/convergence_summary.py). Configurations: no hook, every gradsync codec as a DDP
# hook (gradsync.torch.hooks.codec; sign with block scales and momentum correction, which
# plain sign needs at this learning rate: BENCHMARKS.md), torch's fp16 and PowerSGD hooks, bf16
# autocast; "-ahead": the hook's step-ahead error feedback (train.py --step-ahead).
# Holds /tmp/gradsync-bench.lock, as the other benchmarks do.
#
#   bench/torch/convergence.sh [--ranks 4] [--epochs 15] [--seeds "1 2 3"] [--batch 64]
#                              [--width 256] [--depth 2] [--configs "NAME ..."] [--timeout 900]
#                              [--out DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
ranks=4
epochs=15
seeds="1 2 3"
batch=64
width=256
depth=2
timeout_s=900
out=
declare -A config_args=(
  [float32]="--hook none"
  [bf16-autocast]="--hook none --amp bf16"
  [torch:fp16]="--hook fp16"
  [torch:powersgd]="--hook powersgd"
  [fp16]="--hook gradsync:fp16"
  [bf16]="--hook gradsync:bf16"
  [int8]="--hook gradsync:int8"
  [qsgd]="--hook gradsync:qsgd:levels=15"
  [topk]="--hook gradsync:topk:ratio=0.01"
  [topk-ahead]="--hook gradsync:topk:ratio=0.01 --step-ahead"
  [randomk]="--hook gradsync:randomk:ratio=0.01"
  [randomk-ahead]="--hook gradsync:randomk:ratio=0.01 --step-ahead"
  [threshold]="--hook gradsync:threshold:rel=0.1"
  [sign]="--hook gradsync:sign:block=256,momentum=0.9"
  [powersgd]="--hook gradsync:powersgd:rank=4"
)
configs="float32 bf16-autocast torch:fp16 torch:powersgd fp16 bf16 int8 qsgd topk randomk threshold sign powersgd"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --ranks) ranks=$2; shift 2 ;;
    --epochs) epochs=$2; shift 2 ;;
    --seeds) seeds=$2; shift 2 ;;
    --batch) batch=$2; shift 2 ;;
    --width) width=$2; shift 2 ;;
    --depth) depth=$2; shift 2 ;;
    --configs) configs=$2; shift 2 ;;
    --timeout) timeout_s=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done
for c in $configs; do
  [[ -n ${config_args[$c]:-} ]] || { echo "convergence.sh: no configuration $c" >&2; exit 2; }
done
if [[ -z $out ]]; then
  out=$(mktemp -d /tmp/torch_convergence.XXXXXX)
  trap 'rm -rf "$out"' EXIT
fi
source "$here/torchrun.sh"

exec 9>/tmp/gradsync-bench.lock
flock -n 9 || { echo "convergence.sh: waiting for /tmp/gradsync-bench.lock" >&2; flock 9; }
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
for seed in $seeds; do
  for c in $configs; do
    echo "convergence.sh: seed $seed, $c" >&2
    # shellcheck disable=SC2086  # the configuration's arguments are words
    torch_job "$out" "$timeout_s" "$c~$seed" "$ranks" "$here/../../examples/torch/train.py" \
      --backend gradsync --model mlp --width "$width" --depth "$depth" --epochs "$epochs" \
      --batch "$batch" --seed "$seed" --no-progress ${config_args[$c]}
  done
done
flock -u 9
/usr/bin/python3 "$here/convergence_summary.py" "$out"
