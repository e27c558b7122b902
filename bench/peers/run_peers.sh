#!/usr/bin/env bash
# Compares gradsync's all-reduce with Open MPI's and Gloo's on this machine (or, with
# --collective allgather, its all-gather with Open MPI's; with --collective pingpong, its
# point-to-point latency with Open MPI's) and prints a markdown
# table for BENCHMARKS.md. Builds nothing: point it at a build directory.
#
# Benchmarks are alternated (every repeat runs each of them once per size and rank count,
# in a rotated order) so that a slow phase of a shared machine hurts all of them alike;
# the table reports medians over the repeats.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bench/peers/run_peers.sh [options]
  --build DIR        build directory (default: build); binaries are looked up in
                     DIR/tools and DIR/bench/peers
  --peers-dir DIR    where mpi_allreduce_bench and gloo_allreduce_bench are
                     (default: DIR/bench/peers)
  --ranks "2 4"      rank counts
  --sizes "4K 1M 64M 256M"
                     message sizes (K/M/G = powers of 1024)
  --repeats R        runs of every benchmark per point (default 3)
  --collective C     allreduce (default); allgather (size = the whole output, ranks x
                     block; busbw = algbw * (n-1)/n; mpi_allgather_bench, no Gloo); or
                     pingpong: ranks 0 and 1 send each size back and forth (gradsync-bench
                     pingpong, mpi_pingpong_bench; no Gloo); time is one way, half the
                     round trip, and busbw = size / that time
  --transport T      shm (default): gradsync shm, MPI vader, Gloo tcp (Gloo has no shm);
                     tcp: gradsync tcp, MPI btl tcp, Gloo tcp, all over loopback;
                     ucx: gradsync ucx and Open MPI's pml ucx, both over UCX's shared
                     memory (UCX_TLS=sm), and gradsync's shm transport, no Gloo
  --gloo-algos "ring_chunked halving_doubling"
                     gloo_allreduce_bench --algo values to run (each is one peer)
  --iters-bytes B    timed calls per size = clamp(B / size, 3, MAX) (default 256M)
  --max-iters MAX    cap on timed calls per size (default 200; latency of small messages
                     wants thousands: a 200-call loop of 1 us calls is at the mercy of
                     one scheduling blip)
  --timeout-s S      limit for one run (default 300)
  --offset B         every benchmark's buffers start B bytes past a page (default 0; a
                     multiple of 4 below 4096)
  --out FILE         also write the markdown to FILE
  --keep DIR         keep the per-run JSON in DIR (default: a temporary directory, removed)
Timing of every benchmark: per rank, a loop of `iters` calls after iters/5 warm-up calls,
mean per call, max over ranks. busbw = algbw * 2(n-1)/n, GB/s = 1e9 B/s.
EOF
}

build=build
peers_dir=""
ranks="2 4"
sizes="4K 1M 64M 256M"
repeats=3
transport=shm
collective=allreduce
gloo_algos="ring_chunked halving_doubling"
iters_bytes=256M
max_iters=200
run_timeout=300
offset=0
out=""
keep=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --peers-dir) peers_dir=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    --sizes) sizes=$2; shift 2 ;;
    --repeats) repeats=$2; shift 2 ;;
    --transport) transport=$2; shift 2 ;;
    --collective) collective=$2; shift 2 ;;
    --gloo-algos) gloo_algos=$2; shift 2 ;;
    --iters-bytes) iters_bytes=$2; shift 2 ;;
    --max-iters) max_iters=$2; shift 2 ;;
    --timeout-s) run_timeout=$2; shift 2 ;;
    --offset) offset=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --keep) keep=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "run_peers.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
[[ $transport =~ ^(shm|tcp|ucx)$ ]] || { echo "run_peers.sh: --transport shm|tcp|ucx" >&2; exit 2; }
[[ $collective =~ ^(allreduce|allgather|pingpong)$ ]] || {
  echo "run_peers.sh: --collective allreduce|allgather|pingpong" >&2
  exit 2
}
peers_dir=${peers_dir:-$build/bench/peers}

to_bytes() {
  local v=$1 n=${1%[KkMmGg]}
  case "$v" in
    *[Kk]) echo $((n << 10)) ;;
    *[Mm]) echo $((n << 20)) ;;
    *[Gg]) echo $((n << 30)) ;;
    *) echo "$v" ;;
  esac
}

launcher=$build/tools/gradsync-run
gbench=$build/tools/gradsync-bench
mpi_bench=$peers_dir/mpi_${collective}_bench
gloo_bench=$peers_dir/gloo_allreduce_bench
for f in "$launcher" "$gbench"; do
  [[ -x $f ]] || { echo "run_peers.sh: $f not built" >&2; exit 1; }
done

# Every benchmark is one name here; a missing peer binary only removes that peer.
benches=(gradsync)
[[ $transport == ucx ]] && benches+=(gradsync-shm)
if [[ -x $mpi_bench ]] && command -v mpirun >/dev/null; then
  if [[ $transport == ucx ]]; then
    benches+=(mpi-ucx)
  elif [[ $collective == pingpong ]]; then
    benches+=(mpi-default)
  else
    benches+=(mpi-default mpi-ring)
  fi
else
  echo "run_peers.sh: no $mpi_bench or mpirun; skipping MPI" >&2
fi
if [[ $collective != allreduce ]]; then
  :  # gloo_allreduce_bench has only the all-reduce
elif [[ -x $gloo_bench && $transport != ucx ]]; then
  for a in $gloo_algos; do benches+=("gloo-$a"); done
else
  echo "run_peers.sh: no $gloo_bench; skipping Gloo" >&2
fi

if [[ -n $keep ]]; then
  results=$keep
  mkdir -p "$results"
else
  results=$(mktemp -d /tmp/run_peers.XXXXXX)
  trap 'rm -rf "$results"' EXIT
fi

mpirun_args=(--oversubscribe --bind-to none)  # gradsync-run does not pin either
[[ $(id -u) == 0 ]] && mpirun_args+=(--allow-run-as-root)
if [[ $transport == shm ]]; then
  mpirun_args+=(--mca btl "self,vader")
elif [[ $transport == ucx ]]; then
  # Both sides over UCX's shared memory, the same UCX library. Open MPI 4.1's pml ucx takes
  # only InfiniBand/RoCE devices unless told any will do ("PML ucx cannot be selected").
  export UCX_TLS=sm
  mpirun_args+=(--mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any -x UCX_TLS)
else
  mpirun_args+=(--mca btl "self,tcp" --mca btl_tcp_if_include lo)
fi

# run_one BENCH N BYTES ITERS WARMUP JSON
run_one() {
  local bench=$1 n=$2 bytes=$3 iters=$4 warmup=$5 json=$6
  local sweep=(--min-bytes "$bytes" --max-bytes "$bytes" --iters "$iters" --warmup "$warmup" --json "$json"
    --offset "$offset")
  case "$bench" in
    gradsync)
      timeout "$run_timeout" "$launcher" -n "$n" --timeout-s "$run_timeout" -- \
        "$gbench" "$collective" --transport "$transport" "${sweep[@]}" ;;
    gradsync-shm)
      timeout "$run_timeout" "$launcher" -n "$n" --timeout-s "$run_timeout" -- \
        "$gbench" "$collective" --transport shm "${sweep[@]}" ;;
    mpi-ucx)
      timeout "$run_timeout" mpirun "${mpirun_args[@]}" -np "$n" "$mpi_bench" --label "$bench" "${sweep[@]}" ;;
    mpi-default)
      timeout "$run_timeout" mpirun "${mpirun_args[@]}" -np "$n" "$mpi_bench" --label "$bench" "${sweep[@]}" ;;
    mpi-ring)
      timeout "$run_timeout" mpirun "${mpirun_args[@]}" -np "$n" \
        --mca coll_tuned_use_dynamic_rules 1 --mca "coll_tuned_${collective}_algorithm" 4 \
        "$mpi_bench" --label "$bench" "${sweep[@]}" ;;
    gloo-*)
      timeout "$run_timeout" "$launcher" -n "$n" --timeout-s "$run_timeout" -- \
        "$gloo_bench" --algo "${bench#gloo-}" --label "$bench" "${sweep[@]}" ;;
  esac
}

failures=0
nb=${#benches[@]}
for ((rep = 0; rep < repeats; rep++)); do
  for n in $ranks; do
    for size in $sizes; do
      bytes=$(to_bytes "$size")
      iters=$(( $(to_bytes "$iters_bytes") / bytes ))
      (( iters < 3 )) && iters=3
      (( iters > max_iters )) && iters=$max_iters
      warmup=$(( iters / 5 > 0 ? iters / 5 : 1 ))
      # Rotate the order each repeat so no benchmark always runs right after the same one.
      for ((k = 0; k < nb; k++)); do
        bench=${benches[$(( (k + rep) % nb ))]}
        json=$results/$bench-n$n-b$bytes-r$rep.json
        echo "run_peers.sh: repeat $((rep + 1))/$repeats  $bench  n=$n  $size  iters=$iters" >&2
        if ! run_one "$bench" "$n" "$bytes" "$iters" "$warmup" "$json" >"$results/last.log" 2>&1; then
          echo "run_peers.sh: $bench n=$n $size failed:" >&2
          tail -5 "$results/last.log" >&2
          rm -f "$json"
          failures=$((failures + 1))
        fi
      done
    done
  done
done

# Medians and the markdown table. Records are read from the per-run JSON files, so the
# table never depends on the benchmarks' human-readable output.
table=$(python3 - "$results" "$transport" "$(nproc)" "$collective" <<'PY'
import glob, json, os, statistics, sys
results, transport, cores, collective = sys.argv[1:5]
points = {}  # (ranks, bytes) -> impl -> list of records
for path in glob.glob(os.path.join(results, "*.json")):
    impl = os.path.basename(path).split("-n")[0]
    with open(path) as f:
        for r in json.load(f):
            points.setdefault((r["ranks"], r["bytes"]), {}).setdefault(impl, []).append(r)

def human(b):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"

def med(recs, key):
    return statistics.median(r[key] for r in recs)

peer_note = {"shm": "MPI over vader (shared memory), Gloo over tcp",
             "tcp": "all over loopback TCP",
             "ucx": "UCX_TLS=sm: gradsync ucx and Open MPI pml ucx; gradsync's shm transport"}[transport]
what = {"pingpong": "Ping-pong between ranks 0 and 1, time one way (half the round trip), "
                    "busbw = size / that time",
        "allgather": "All-gather float32, size = the whole output (ranks x block), "
                     "busbw = algbw x (n-1)/n",
        "allreduce": "All-reduce float32 sum"}[collective]
print(f"{what}, gradsync transport {transport} ({peer_note}); {cores} cores; "
      "busbw in GB/s (1e9 B/s), median over repeats.\n")
print("| size | ranks | gradsync busbw | best peer busbw | best peer | ratio |")
print("|---:|---:|---:|---:|:---|---:|")
for (n, b) in sorted(points, key=lambda p: (p[1], p[0])):
    impls = points[(n, b)]
    ours = med(impls["gradsync"], "busbw_gbps") if "gradsync" in impls else None
    peers = {k: med(v, "busbw_gbps") for k, v in impls.items() if k != "gradsync"}
    best = max(peers, key=peers.get) if peers else None
    cell = lambda x: "-" if x is None else f"{x:.3f}"
    ratio = f"{ours / peers[best]:.2f}x" if ours is not None and best and peers[best] > 0 else "-"
    print(f"| {human(b)} | {n} | {cell(ours)} | {cell(peers.get(best))} | {best or '-'} | {ratio} |")

print("\nEvery implementation (median time per call in us / busbw in GB/s; runs):\n")
names = sorted({k for v in points.values() for k in v}, key=lambda k: (k != "gradsync", k))
print("| size | ranks | " + " | ".join(names) + " |")
print("|---:|---:|" + "---:|" * len(names))
for (n, b) in sorted(points, key=lambda p: (p[1], p[0])):
    row = []
    for k in names:
        recs = points[(n, b)].get(k)
        row.append("-" if not recs else
                   f"{med(recs, 'time_us'):.{2 if med(recs, 'time_us') < 10 else 1}f} / "
                   f"{med(recs, 'busbw_gbps'):.3f} ({len(recs)})")
    print(f"| {human(b)} | {n} | " + " | ".join(row) + " |")
PY
)
echo "$table"
[[ -n $out ]] && echo "$table" >"$out"
if (( failures > 0 )); then
  echo "run_peers.sh: $failures run(s) failed (see messages above)" >&2
  exit 1
fi
