#!/usr/bin/env bash
# All-reduce across "hosts" joined by shaped links: network namespaces of
# scripts/netns-cluster.sh, one launcher per host, exactly as on separate machines. Needs root.
# Prints markdown tables for BENCHMARKS.md. Run one benchmark at a time on this machine.
#
#   bench/netns/cluster_bench.sh [options] link|hier|scaling|codecs|train
#
#   link     4 hosts x 1 rank: gradsync (cost model's choice) and Gloo's chunked ring,
#            alternating; busbw as a fraction of the link rate.
#   hier     2 hosts x 2 ranks: hierarchical, flat ring, parameter server; busbw and the bytes
#            each host sends to other hosts per call (transport counters).
#   scaling  ring and parameter server at a fixed payload on 2, 3, 4, 6, 8 hosts x 1 rank;
#            time per call. Writes DIR/scaling.dat and, with gnuplot, DIR/scaling.png.
#   codecs   4 hosts x 1 rank: the uncompressed all-reduce and each codec of --codecs at the
#            first of --sizes; time per call, wire ratio (bytes sent over a float32 ring's),
#            and time over the uncompressed call: the time saved should follow the bytes.
#   train    4 hosts x 1 rank: gradsync-train (--train-args) with and without overlap,
#            alternating; step time against max(compute, communication), overlap fraction.
#   ucx      4 hosts x 1 rank: gradsync's tcp transport and its ucx transport over UCX's
#            tcp (UCX_TLS=tcp), alternating; busbw as a fraction of the link, ucx / tcp.
#
# options:
#   --build DIR      build directory (default build)
#   --rate R         link rate, tc tbf syntax (default 1gbit)
#   --sizes "16M 64M"  message sizes (scaling: the first one)
#   --repeats R      runs of every point (default 3; medians reported)
#   --iters N        timed calls per run (default 5)
#   --out DIR        where scaling.dat / scaling.png go (default bench/netns)
#   --codecs "fp16 int8"  codec specs of the codecs experiment (default: every codec)
#   --train-args "..."    gradsync-train flags of the train experiment
#                         (default: --model mlp --max-steps 25 --quiet)
#   --timeline DIR   every job writes its Chrome trace (GRADSYNC_TIMELINE) to DIR/NAME.json
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=build
rate=1gbit
sizes="16M 64M"
repeats=3
iters=5
out=$here
train_args="--model mlp --max-steps 25 --quiet"
codecs="fp16 bf16 int8 qsgd topk:ratio=0.01 randomk:ratio=0.01 threshold:rel=0.5 sign powersgd:rank=4"
timeline=""
while [[ $# -gt 1 ]]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --sizes) sizes=$2; shift 2 ;;
    --repeats) repeats=$2; shift 2 ;;
    --iters) iters=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --codecs) codecs=$2; shift 2 ;;
    --train-args) train_args=$2; shift 2 ;;
    --timeline) timeline=$(mkdir -p "$2" && cd "$2" && pwd); shift 2 ;;
    *) echo "cluster_bench: unknown option '$1'" >&2; exit 2 ;;
  esac
done
experiment=${1:-}
[[ $experiment =~ ^(link|hier|scaling|codecs|train|ucx)$ ]] || { sed -n '2,34p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[[ $build = /* ]] || build=$root/$build
cluster=$root/scripts/netns-cluster.sh
prefix=gb
results=$(mktemp -d /tmp/cluster_bench.XXXXXX)
trap '"$cluster" down --prefix $prefix; rm -rf "$results"' EXIT

to_bytes() {
  local s=$1
  case "$s" in
    *K) echo $(( ${s%K} << 10 )) ;;
    *M) echo $(( ${s%M} << 20 )) ;;
    *G) echo $(( ${s%G} << 30 )) ;;
    *) echo "$s" ;;
  esac
}

port=29600
job_env=()  # extra VAR=value for every rank of the next jobs
# job NAME HOSTS PER_HOST BYTES -- program args...: one launcher per host, rank 0 writes
# $results/NAME.json (the programs take --json).
job() {
  local name=$1 hosts=$2 per_host=$3; shift 5  # NAME HOSTS PER_HOST BYTES --
  port=$((port + 1))
  local pids=() h
  for ((h = 0; h < hosts; h++)); do
    "$cluster" exec --prefix $prefix "$h" env GRADSYNC_TOKEN=cluster-bench GRADSYNC_TIMEOUT=120000 "${job_env[@]}" \
      ${timeline:+GRADSYNC_TIMELINE="$timeline/$name.json"} "$build/tools/gradsync-run" --nnodes "$hosts" --node-rank "$h" -n "$per_host" \
      --master-addr "$("$cluster" addr --prefix $prefix 0)" --master-port $port --timeout-s 300 \
      --no-prefix -- "$@" --json "$results/$name.json" >"$results/$name.h$h.log" 2>&1 &
    pids+=($!)
  done
  local failed=0
  for p in "${pids[@]}"; do wait "$p" || failed=1; done
  if ((failed)); then
    echo "cluster_bench: $name failed:" >&2
    for f in "$results/$name".h*.log; do tail -n 5 "$f" >&2; done
    rm -f "$results/$name.json"
  fi
}

gradsync() {  # gradsync NAME HOSTS PER_HOST BYTES ALGO
  local b=$4
  job "$1" "$2" "$3" "$b" -- "$build/tools/gradsync-bench" allreduce --min-bytes "$b" \
    --max-bytes "$b" --iters "$iters" --warmup 1 --algo "$5"
}

gloo() {  # gloo NAME HOSTS BYTES (one rank per host)
  local name=$1 hosts=$2 b=$3
  port=$((port + 1))
  local pids=() h store="$results/gloo-store-$name"
  for ((h = 0; h < hosts; h++)); do
    "$cluster" exec --prefix $prefix "$h" env RANK="$h" WORLD_SIZE="$hosts" \
      "$build/bench/peers/gloo_allreduce_bench" --algo ring_chunked --label gloo \
      --host "$("$cluster" addr --prefix $prefix "$h")" --store-dir "$store" \
      --min-bytes "$b" --max-bytes "$b" --iters "$iters" --warmup 1 \
      --json "$results/$name.json" >"$results/$name.h$h.log" 2>&1 &
    pids+=($!)
  done
  local failed=0
  for p in "${pids[@]}"; do wait "$p" || failed=1; done
  ((failed)) && { echo "cluster_bench: $name failed:" >&2; for f in "$results/$name".h*.log; do tail -n 5 "$f" >&2; done; rm -f "$results/$name.json"; }
  return 0
}

summarize() {  # python over $results/*.json: name = impl~hosts~perhost~bytes~rep
  python3 - "$results" "$experiment" "$rate" "$@" <<'PY'
import glob, json, os, re, statistics, sys
results, experiment, rate = sys.argv[1], sys.argv[2], sys.argv[3]
specs = os.environ.get("CODEC_SPECS", "").split()
bits = float(re.match(r"(\d+)", rate).group(1)) * {"g": 1e9, "m": 1e6, "k": 1e3}[rate.lower().rstrip("bit")[-1]]
link_gbps = bits / 8 / 1e9
pts = {}
for path in glob.glob(os.path.join(results, "*.json")):
    impl, hosts, per_host, b, rep = os.path.basename(path)[:-5].split("~")
    records = json.load(open(path))
    for r in records if isinstance(records, list) else [records]:
        pts.setdefault((int(hosts), int(per_host), int(b)), {}).setdefault(impl, []).append(r)
med = lambda rs, k: statistics.median(r[k] for r in rs)
mib = lambda b: f"{b >> 20} MiB"
if experiment == "link":
    print(f"| size | gradsync busbw (fraction of {rate}) | Gloo ring_chunked busbw (fraction) | gradsync / Gloo | gradsync algorithm |")
    print("|---:|---:|---:|---:|:---|")
    for (h, l, b), impls in sorted(pts.items(), key=lambda kv: kv[0][2]):
        g, o = med(impls["gradsync"], "busbw_gbps"), med(impls["gloo"], "busbw_gbps")
        algo = "/".join(sorted({r["algo"] for r in impls["gradsync"]}))
        print(f"| {mib(b)} | {g:.4f} GB/s ({g / link_gbps:.3f}) | {o:.4f} GB/s ({o / link_gbps:.3f}) | {g / o:.2f}x | {algo} |")
elif experiment == "ucx":
    print(f"| size | tcp transport busbw (fraction of {rate}) | ucx transport busbw (fraction) | ucx / tcp | algorithm |")
    print("|---:|---:|---:|---:|:---|")
    for (h, l, b), impls in sorted(pts.items(), key=lambda kv: kv[0][2]):
        t, u = med(impls["tcp"], "busbw_gbps"), med(impls["ucx"], "busbw_gbps")
        algo = "/".join(sorted({r["algo"] for r in impls["tcp"] + impls["ucx"]}))
        print(f"| {mib(b)} | {t:.4f} GB/s ({t / link_gbps:.3f}) | {u:.4f} GB/s ({u / link_gbps:.3f}) | {u / t:.3f}x | {algo} |")
elif experiment == "hier":
    print(f"| size | algorithm | time per call | busbw | bytes across hosts per host per call | / S |")
    print("|---:|:---|---:|---:|---:|---:|")
    for (h, l, b), impls in sorted(pts.items(), key=lambda kv: kv[0][2]):
        ring = med(impls["ring"], "time_us") if "ring" in impls else None
        for impl in ("hier", "ring", "ps", "auto"):
            if impl not in impls: continue
            rs = impls[impl]
            t, bw = med(rs, "time_us"), med(rs, "busbw_gbps")
            per_host = med(rs, "bytes_across_hosts") / h
            speed = f" ({ring / t:.2f}x ring)" if ring and impl != "ring" else ""
            name = impl if impl != "auto" else "auto (" + "/".join(sorted({r["algo"] for r in rs})) + ")"
            print(f"| {mib(b)} | {name} | {t / 1000:.1f} ms{speed} | {bw:.4f} GB/s | {per_host / 1048576:.1f} MiB | {per_host / b:.2f} |")
elif experiment == "train":
    (h, l, b), impls = next(iter(pts.items()))
    print(f"{h} hosts x {l} rank, {rate} links; medians of {len(impls['overlap'])} runs (steps after the first 5)\n")
    # The last column holds the step against the two run alone: the no-overlap run's compute
    # and communication (overlapped, both slow down where they share the cores).
    print("| mode | step | compute (step - exposed) | communication | exposed | overlap | step / max(compute, communication) | step / max of the two alone |")
    print("|:---|---:|---:|---:|---:|---:|---:|---:|")
    def step_of(r):
        w = r["wall_at_step"]
        return statistics.median(w[i] - w[i - 1] for i in range(6, len(w)))
    alone = None
    if "no-overlap" in impls:
        rs = impls["no-overlap"]
        alone = max(statistics.median(step_of(r) for r in rs) - med(rs, "exposed_s_per_step"),
                    med(rs, "communication_s_per_step"))
    for mode in ("overlap", "no-overlap"):
        if mode not in impls: continue
        rs = impls[mode]
        step = statistics.median(step_of(r) for r in rs)
        comm = med(rs, "communication_s_per_step")
        exposed = med(rs, "exposed_s_per_step")
        compute = step - exposed
        print(f"| {mode} | {step * 1000:.0f} ms | {compute * 1000:.0f} ms | {comm * 1000:.0f} ms | "
              f"{exposed * 1000:.0f} ms | {max(0.0, 1 - exposed / comm) if comm else 0:.2f} | "
              f"{step / max(compute, comm):.2f}x | {f'{step / alone:.2f}x' if alone else '-'} |")
elif experiment == "codecs":
    (h, l, b), impls = next(iter(pts.items()))
    plain = med(impls["plain"], "time_us")
    print(f"{h} hosts x {l} rank, {mib(b)} of float32 per rank, {rate} links; median of {len(impls['plain'])} runs\n")
    print("| codec | time per call | / uncompressed | wire (x float32 ring) |")
    print("|:---|---:|---:|---:|")
    print(f"| uncompressed ({'/'.join(sorted({r['algo'] for r in impls['plain']}))}) | {plain / 1000:.0f} ms | 1.00x | 1.000 |")
    for i, spec in enumerate(specs):
        if f"c{i}" not in impls: continue
        rs = impls[f"c{i}"]
        t = med(rs, "time_us")
        print(f"| {spec} | {t / 1000:.0f} ms | {t / plain:.3f}x | {med(rs, 'wire_ratio'):.3f} |")
else:
    out = sys.argv[4]
    rows = sorted({h for (h, l, b) in pts})
    b = next(iter(pts))[2]
    print(f"Payload {mib(b)}, 1 rank per host, time per all-reduce in ms (median):\n")
    print("| hosts | ring | parameter server | ps / ring |")
    print("|---:|---:|---:|---:|")
    with open(os.path.join(out, "scaling.dat"), "w") as f:
        f.write(f"# hosts ring_ms ps_ms  ({mib(b)}, {rate} links)\n")
        for h in rows:
            impls = pts[(h, 1, b)]
            r, p = med(impls["ring"], "time_us") / 1000, med(impls["ps"], "time_us") / 1000
            f.write(f"{h} {r:.2f} {p:.2f}\n")
            print(f"| {h} | {r:.1f} | {p:.1f} | {p / r:.2f}x |")
PY
}

"$cluster" up --prefix $prefix --hosts 8 --rate "$rate" >/dev/null
case "$experiment" in
  link)
    for ((rep = 0; rep < repeats; rep++)); do
      for size in $sizes; do
        b=$(to_bytes "$size")
        echo "cluster_bench: link repeat $((rep + 1))/$repeats $size" >&2
        if ((rep % 2)); then gloo "gloo~4~1~$b~$rep" 4 "$b"; gradsync "gradsync~4~1~$b~$rep" 4 1 "$b" auto
        else gradsync "gradsync~4~1~$b~$rep" 4 1 "$b" auto; gloo "gloo~4~1~$b~$rep" 4 "$b"; fi
      done
    done
    summarize ;;
  ucx)
    for ((rep = 0; rep < repeats; rep++)); do
      for size in $sizes; do
        b=$(to_bytes "$size")
        order=(tcp ucx)
        ((rep % 2)) && order=(ucx tcp)
        for t in "${order[@]}"; do
          echo "cluster_bench: ucx repeat $((rep + 1))/$repeats $size $t" >&2
          job_env=(GRADSYNC_TRANSPORT="$t")
          [[ $t == ucx ]] && job_env+=(UCX_TLS=tcp UCX_NET_DEVICES=eth0)
          gradsync "$t~4~1~$b~$rep" 4 1 "$b" auto
        done
      done
    done
    job_env=()
    summarize ;;
  hier)
    for ((rep = 0; rep < repeats; rep++)); do
      for size in $sizes; do
        b=$(to_bytes "$size")
        for algo in hier ring ps auto; do
          echo "cluster_bench: hier repeat $((rep + 1))/$repeats $size $algo" >&2
          gradsync "$algo~2~2~$b~$rep" 2 2 "$b" "$algo"
        done
      done
    done
    summarize ;;
  train)
    for ((rep = 0; rep < repeats; rep++)); do
      for mode in overlap no-overlap; do
        echo "cluster_bench: train repeat $((rep + 1))/$repeats $mode" >&2
        extra=()
        [[ $mode == no-overlap ]] && extra=(--no-overlap)
        # shellcheck disable=SC2086
        job "$mode~4~1~0~$rep" 4 1 0 -- "$build/examples/gradsync-train" $train_args "${extra[@]}"
      done
    done
    summarize ;;
  codecs)
    b=$(to_bytes "${sizes%% *}")
    for ((rep = 0; rep < repeats; rep++)); do
      echo "cluster_bench: codecs repeat $((rep + 1))/$repeats uncompressed" >&2
      gradsync "plain~4~1~$b~$rep" 4 1 "$b" auto
      i=0
      for spec in $codecs; do
        echo "cluster_bench: codecs repeat $((rep + 1))/$repeats $spec" >&2
        job "c$i~4~1~$b~$rep" 4 1 "$b" -- "$build/tools/gradsync-bench" allreduce --min-bytes "$b" \
          --max-bytes "$b" --iters "$iters" --warmup 1 --codec "$spec"
        i=$((i + 1))
      done
    done
    CODEC_SPECS="$codecs" summarize ;;
  scaling)
    b=$(to_bytes "${sizes%% *}")
    for ((rep = 0; rep < repeats; rep++)); do
      for hosts in 2 3 4 6 8; do
        for algo in ring ps; do
          echo "cluster_bench: scaling repeat $((rep + 1))/$repeats $hosts hosts $algo" >&2
          gradsync "$algo~$hosts~1~$b~$rep" "$hosts" 1 "$b" "$algo"
        done
      done
    done
    mkdir -p "$out"
    summarize "$out"
    if command -v gnuplot >/dev/null; then
      gnuplot -e "datafile='$out/scaling.dat'; outfile='$out/scaling.png'" "$here/scaling.gp"
      echo "cluster_bench: wrote $out/scaling.png" >&2
    else
      echo "cluster_bench: gnuplot not installed (scripts/install-deps.sh installs it); no plot" >&2
    fi ;;
esac
