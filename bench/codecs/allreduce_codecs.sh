#!/usr/bin/env bash
# Compressed all-reduce per codec on one host: N ranks over the shared-memory transport (the
# default), or --transport tcp for loopback sockets. Every codec runs in turn, the
# uncompressed all-reduce alongside in the same rounds, repeated, every call timed alone
# after a barrier (gradsync-bench --per-call, what codec calls need: they run in place); prints a markdown table of
# median time per call, the ratio to the uncompressed call, and the wire ratio (bytes each
# rank sent over a float32 ring's; 0 where the shared-memory arena carries the data and no
# transport counts it). Holds /tmp/gradsync-bench.lock while it runs.
#
#   bench/codecs/allreduce_codecs.sh [--build DIR] [--ranks N] [--size 64M] [--repeats R]
#                                    [--iters N] [--transport shm|tcp] [--codecs "fp16 int8 ..."]
#   a codec written SPEC@propagate runs without the NaN/Inf check (gradsync-bench --non-finite)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=build
ranks=4
size=64M
repeats=5
iters=5
transport=""
codecs="none fp16 bf16 int8 qsgd topk:ratio=0.01 randomk:ratio=0.01 threshold:rel=0.5 sign powersgd:rank=4"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --repeats) repeats=$2; shift 2 ;;
    --iters) iters=$2; shift 2 ;;
    --transport) transport=$2; shift 2 ;;
    --codecs) codecs=$2; shift 2 ;;
    *) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done
[[ $build = /* ]] || build=$root/$build
results=$(mktemp -d /tmp/allreduce_codecs.XXXXXX)
trap 'rm -rf "$results"' EXIT
transport_args=()
[[ -n $transport ]] && transport_args=(--transport "$transport")

exec 9>/tmp/gradsync-bench.lock
flock 9
for ((rep = 0; rep < repeats; rep++)); do
  i=0
  for spec in plain $codecs; do
    echo "allreduce_codecs: repeat $((rep + 1))/$repeats $spec" >&2
    codec_args=()
    # SPEC@propagate: the codec without the NaN/Inf check.
    [[ $spec != plain ]] && codec_args=(--codec "${spec%@*}")
    [[ $spec == *@* ]] && codec_args+=(--non-finite "${spec#*@}")
    "$build/tools/gradsync-run" -n "$ranks" --no-prefix -- "$build/tools/gradsync-bench" \
      allreduce --min-bytes "$size" --max-bytes "$size" --iters "$iters" --warmup 2 --per-call \
      "${transport_args[@]}" "${codec_args[@]}" --json "$results/$i~$rep.json" >/dev/null
    i=$((i + 1))
  done
done
python3 - "$results" "$ranks" "$size" "${transport:-shm}" plain $codecs <<'PY'
import glob, json, os, statistics, sys
results, ranks, size, transport, specs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
runs = {}
for path in glob.glob(os.path.join(results, "*.json")):
    i, rep = os.path.basename(path)[:-5].split("~")
    runs.setdefault(int(i), []).extend(json.load(open(path)))
med = lambda i, k: statistics.median(r[k] for r in runs[i])
plain = med(0, "time_us")
print(f"{ranks} ranks, {size} of float32 per rank, {transport}; median of {len(runs[0])} runs\n")
print("| codec | time per call | / uncompressed | wire (x float32 ring) |")
print("|:---|---:|---:|---:|")
for i, spec in enumerate(specs):
    t = med(i, "time_us")
    wire = "-" if i == 0 else f"{med(i, 'wire_ratio'):.3f}"
    print(f"| {spec if i else 'uncompressed allreduce'} | {t / 1000:.1f} ms | {t / plain:.2f}x | {wire} |")
PY
