#!/usr/bin/env bash
# PyTorch on gradsync's c10d backend against gloo: collectives.py and ddp_step.py under
# torchrun (Debian's torch 1.13, /usr/bin/python3) for each backend at each world size,
# the backends alternating within every repetition so that drift on the machine hits
# both; then a table of medians with the gradsync/gloo time ratio (bench/torch/summarize.py).
# Without an importable gradsync.torch (PYTHONPATH) it runs and reports gloo only.
# Holds /tmp/gradsync-bench.lock, as the other benchmarks do, so they do not overlap.
#
#   bench/torch/run.sh [--ranks "2 4"] [--repeats 3] [--backends "gloo gradsync"]
#                      [--ops all_reduce] [--sizes 4KiB,64MiB] [--iters 20] [--warmup 5]
#                      [--hooks none] [--steps 30] [--step-warmup 5] [--width 2048]
#                      [--depth 4] [--timeout 600] [--out DIR] [--no-collectives] [--no-ddp]
#
# --out DIR keeps every run's JSON and log there (default: a temporary directory, removed).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=/usr/bin/python3  # Debian's torch runs only under this interpreter
ranks="2 4"
repeats=3
backends="gloo gradsync"
ops=all_reduce
sizes=4KiB,64MiB
iters=20
warmup=5
hooks=none
steps=30
step_warmup=5
width=2048
depth=4
timeout_s=600
out=
collectives=1
ddp=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --ranks) ranks=$2; shift 2 ;;
    --repeats) repeats=$2; shift 2 ;;
    --backends) backends=$2; shift 2 ;;
    --ops) ops=$2; shift 2 ;;
    --sizes) sizes=$2; shift 2 ;;
    --iters) iters=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --hooks) hooks=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --step-warmup) step_warmup=$2; shift 2 ;;
    --width) width=$2; shift 2 ;;
    --depth) depth=$2; shift 2 ;;
    --timeout) timeout_s=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --no-collectives) collectives=0; shift ;;
    --no-ddp) ddp=0; shift ;;
    *) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done

if [[ -z $out ]]; then
  out=$(mktemp -d /tmp/torch_bench.XXXXXX)
  trap 'rm -rf "$out"' EXIT
fi
mkdir -p "$out/logs"

# gradsync only where its module imports; say why not otherwise.
available=
for b in $backends; do
  if [[ $b == gradsync ]] && ! why=$("$python" -c 'import gradsync.torch' 2>&1); then
    echo "run.sh: gradsync.torch does not import ($(tail -n 1 <<<"$why")): gloo only" >&2
    continue
  fi
  available+=" $b"
done
[[ -n $available ]] || { echo "run.sh: no backend to run" >&2; exit 1; }

source "$here/torchrun.sh"
job() { torch_job "$out" "$timeout_s" "$1" "$2" "$here/$3" "${@:4}"; }

exec 9>/tmp/gradsync-bench.lock
flock -n 9 || { echo "run.sh: waiting for /tmp/gradsync-bench.lock" >&2; flock 9; }
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
for ((rep = 0; rep < repeats; rep++)); do
  for n in $ranks; do
    for b in $available; do
      echo "run.sh: repetition $((rep + 1))/$repeats, $n ranks, $b" >&2
      if ((collectives)); then
        job "coll~$b~$n~$rep" "$n" collectives.py --backend "$b" --op "$ops" \
          --sizes "$sizes" --iters "$iters" --warmup "$warmup"
      fi
      if ((ddp)); then
        h=0
        for hook in $hooks; do
          job "step~$b~$n~h$h~$rep" "$n" ddp_step.py --backend "$b" --hook "$hook" \
            --steps "$steps" --warmup "$step_warmup" --width "$width" --depth "$depth"
          h=$((h + 1))
        done
      fi
    done
  done
done
flock -u 9
"$python" "$here/summarize.py" "$out"
