#!/usr/bin/env bash
# Gradient-codec throughput on one core: codec_bench (gradsync's codecs through the public
# API, its kernels, memcpy) and then PyTorch's CPU equivalents (bench/peers/
# torch_codec_bench.py), under one lock so no other benchmark shares the machine, then
# markdown tables: gradsync beside PyTorch for the ops both have, every codec's encode and
# decode against the memcpy measured in the same run, and the kernels' vector and scalar
# paths. Builds nothing: point it at a build directory.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bench/codecs/run_codec_bench.sh [options]
  --build DIR         build directory holding bench/codec_bench (default: build)
  --quick             1M and 16M only, one repetition (a smoke run: a few tens of seconds)
  --repetitions N     codec_bench repetitions, medians reported (default 5)
  --python PATH       interpreter with torch (default /usr/bin/python3: Debian's python3-torch)
  --out FILE          also write the tables to FILE
  --keep DIR          keep the raw results (codec_bench JSON, torch JSON lines) in DIR
All rates are GB/s (1e9 B/s) of float32 INPUT bytes (count * 4) on one thread. Waits for
/tmp/gradsync-bench.lock while another benchmark holds it.
EOF
}

build=build
quick=0
repetitions=5
python=/usr/bin/python3
out=""
keep=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    --repetitions) repetitions=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --keep) keep=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "run_codec_bench.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bench=$build/bench/codec_bench
[[ -x $bench ]] || { echo "run_codec_bench.sh: no $bench (build the codec_bench target)" >&2; exit 1; }

if [[ -n $keep ]]; then
  mkdir -p "$keep"
  dir=$keep
else
  dir=$(mktemp -d)
  trap 'rm -rf "$dir"' EXIT
fi

sizes=1M,16M,64M
filter=.
if [[ $quick == 1 ]]; then
  sizes=1M,16M
  repetitions=1
  filter='/(1M|16M)/'
fi

# Both runs under the lock, one after the other: a benchmark running beside this one (or
# the torch run beside codec_bench) would halve what either measures on 2 cores.
exec 9>/tmp/gradsync-bench.lock
if ! flock -n 9; then
  echo "run_codec_bench.sh: waiting for /tmp/gradsync-bench.lock" >&2
  flock 9
fi

codec_cmd=("$bench" "--benchmark_filter=$filter" "--benchmark_repetitions=$repetitions"
           --benchmark_report_aggregates_only=true "--benchmark_out=$dir/codec_bench.json"
           --benchmark_out_format=json)
echo "+ ${codec_cmd[*]}" >&2
"${codec_cmd[@]}" >&2

torch_ok=1
if "$python" -c 'import torch' 2>/dev/null; then
  torch_cmd=("$python" "$here/../peers/torch_codec_bench.py" --sizes "$sizes")
  [[ $quick == 1 ]] && torch_cmd+=(--repeats 3 --no-kthvalue)
  echo "+ ${torch_cmd[*]}" >&2
  "${torch_cmd[@]}" | tee "$dir/torch.jsonl" >&2
else
  torch_ok=0
  echo "run_codec_bench.sh: $python cannot import torch (apt-get install python3-torch):" \
       "PyTorch columns left empty" >&2
  : >"$dir/torch.jsonl"
fi
flock -u 9

# python3 is there whenever torch is; the tables need only the standard library.
python3 - "$dir/codec_bench.json" "$dir/torch.jsonl" "$torch_ok" "$sizes" >"$dir/tables.md" <<'EOF'
import json, re, sys

bench_json, torch_jsonl, torch_ok, sizes = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4].split(",")
data = json.load(open(bench_json))

# Medians when repetitions were aggregated, the single run otherwise; keyed by the name
# without Google Benchmark's "/min_time:..." suffix.
runs = {}
for b in data["benchmarks"]:
    aggregate = b.get("aggregate_name")
    if aggregate not in (None, "median"):
        continue
    name = re.sub(r"/(min_time|iterations):[^/]*$", "", b.get("run_name", b["name"]))
    if aggregate is None and name in runs:
        continue
    runs[name] = b

def gbps(name):
    b = runs.get(name)
    return b["bytes_per_second"] / 1e9 if b else None

torch = {}
for line in open(torch_jsonl):
    if line.strip():
        r = json.loads(line)
        torch[(r["op"], r["size"])] = r
torch_version = next(iter(torch.values()))["version"] if torch else "n/a"

def f(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"

def ratio(a, b):
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"

ctx = data.get("context", {})
print(f"Machine: {ctx.get('num_cpus', '?')} CPUs at {ctx.get('mhz_per_cpu', '?')} MHz, "
      f"{ctx.get('host_name', '')}; kernels: {next((b.get('label') for n, b in runs.items() if n.startswith('kernel/') and not n.endswith('/scalar')), '?')}; "
      f"PyTorch {torch_version}{'' if torch_ok else ' (not installed)'}, 1 thread.")
print()
print("gradsync beside PyTorch (GB/s of float32 input, one thread, medians; torch both into a")
print("preallocated tensor, as gradsync writes, and as the usual idiom, which allocates its output):")
print()
print("| op | size | gradsync | GB/s | torch | GB/s | torch idiom | GB/s | gradsync / torch |")
print("|---|---|---|---|---|---|---|---|---|")
topk = "encode/topk:ratio=0.01,ef=0" if any(n.startswith("encode/topk:ratio=0.01,ef=0/") for n in runs) else "encode/topk:ratio=0.01"
topk_exact = "encode/topk:ratio=0.01,exact=1,ef=0"
select = ("topk_1pct", "topk(x.abs(), k, sorted=False)", "topk_1pct_sorted", "topk(x.abs(), k)")
pairs = [
    ("fp16 cast", "kernel/float_to_half", ("fp16_cast", "h.copy_(x)", "fp16_cast_alloc", "x.half()")),
    ("fp16 cast", "encode/fp16", ("fp16_cast", "h.copy_(x)", "fp16_cast_alloc", "x.half()")),
    ("bf16 cast", "kernel/float_to_bfloat16", ("bf16_cast", "b.copy_(x)", "bf16_cast_alloc", "x.bfloat16()")),
    ("fp16 decode", "decode/fp16", ("fp16_to_float", "x.copy_(h)", "fp16_to_float_alloc", "h.float()")),
    ("topk 1%", topk, select),
    ("topk 1% exact", topk_exact, select),
]
for size in sizes:
    for op, ours, (theirs, label, idiom, idiom_label) in pairs:
        g = gbps(f"{ours}/{size}")
        if g is None:
            continue
        t = torch.get((theirs, size), {}).get("gbps")
        ti = torch.get((idiom, size), {}).get("gbps")
        print(f"| {op} | {size} | `{ours}` | {f(g)} | `{label}` | {f(t)} | `{idiom_label}` | {f(ti)} | {ratio(g, t)} |")
print()
print("Codecs against memcpy of the same bytes in the same run (GB/s of float32 input; payload:")
print("encoded bytes over input bytes; specs without ef=0 run with their default error feedback):")
print()
print("| codec | size | encode | decode | memcpy | encode / memcpy | decode / memcpy | payload |")
print("|---|---|---|---|---|---|---|---|")
specs = []
for name in runs:
    m = re.match(r"encode/(.*)/(\d+M)$", name)
    if m and m.group(1) not in specs:
        specs.append(m.group(1))
for spec in specs:
    for size in sizes:
        e, d, mc = gbps(f"encode/{spec}/{size}"), gbps(f"decode/{spec}/{size}"), gbps(f"memcpy/{size}")
        if e is None and d is None:
            continue
        payload = runs.get(f"encode/{spec}/{size}", {}).get("payload_ratio")
        print(f"| `{spec}` | {size} | {f(e)} | {f(d)} | {f(mc)} | {ratio(e, mc)} | {ratio(d, mc)} | {f(payload, 4)} |")
print()
print("Kernels (GB/s of float32 input; scalar: the portable fallback forced, at 16M):")
print()
print("| kernel | " + " | ".join(sizes) + " | 16M scalar | vector / scalar |")
print("|---|" + "---|" * (len(sizes) + 2))
kernels = []
for name in runs:
    m = re.match(r"kernel/([^/]+)/", name)
    if m and m.group(1) not in kernels:
        kernels.append(m.group(1))
for k in ["memcpy"] + kernels:
    prefix = "memcpy" if k == "memcpy" else f"kernel/{k}"
    row = [gbps(f"{prefix}/{s}") for s in sizes]
    scalar = gbps(f"kernel/{k}/16M/scalar")
    print(f"| {k} | " + " | ".join(f(x) for x in row) + f" | {f(scalar)} | {ratio(gbps(f'{prefix}/16M'), scalar)} |")
EOF

cat "$dir/tables.md"
[[ -n $out ]] && cp "$dir/tables.md" "$out"
exit 0
