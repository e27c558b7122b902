#!/usr/bin/python3
"""PyTorch's CPU versions of what gradsync's codecs do, timed for bench/codec_bench.cc.

The same sizes (1M, 16M, 64M floats) and the same kind of data (normal(0, 1e-3) with one
outlier of 0.05..0.5 in about 10^4, fixed seed) on one thread. Every op is reported as
GB/s of INPUT float32 bytes (count * 4 / median seconds / 1e9), the unit codec_bench uses,
one JSON object per line:
  {"impl": "torch", "op": "fp16_cast", "count": 1048576, "repeats": 20,
   "median_s": ..., "gbps": ...}
Ops: fp16_cast / bf16_cast / fp16_to_float write into a preallocated tensor (copy_), as
gradsync's kernels and codecs do; *_alloc are the idioms x.half(), x.bfloat16(), h.float(),
which also pay for a fresh output each call; topk_1pct is torch.topk(x.abs(), k, sorted=False)
with k = ceil(0.01 n) (topk_1pct_sorted: the default sorted=True); kthvalue_1pct finds the
same threshold with torch.kthvalue.
Run with Debian's interpreter and python3-torch: /usr/bin/python3 bench/peers/torch_codec_bench.py
"""

import argparse
import json
import math
import statistics
import sys
import time

import torch

SIZES = {"1M": 1 << 20, "16M": 16 << 20, "64M": 64 << 20}


def gradient(n, seed=20240917):
    """normal(0, 1e-3) with outliers of magnitude 0.05..0.5 at about one in 10^4."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 1e-3
    outliers = torch.rand(n, generator=g) < 1e-4
    magnitude = 0.05 + 0.45 * torch.rand(int(outliers.sum()), generator=g)
    x[outliers] = torch.copysign(magnitude, x[outliers])
    return x.contiguous()


def time_op(fn, repeats):
    fn()  # warm-up: first-touch page faults, lazy initialisation
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1M,16M,64M", help="comma-separated: 1M,16M,64M")
    parser.add_argument("--repeats", type=int, default=0,
                        help="timed calls per op and size (default: 20/7/5 by size)")
    parser.add_argument("--no-kthvalue", action="store_true", help="skip torch.kthvalue")
    args = parser.parse_args()

    # One thread: codec_bench measures one core, and these ops are what a rank does alone.
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)

    for name in args.sizes.split(","):
        n = SIZES[name]
        repeats = args.repeats or {"1M": 20, "16M": 7, "64M": 5}[name]
        x = gradient(n)
        h = x.half()
        b = x.bfloat16()
        out16 = torch.empty(n, dtype=torch.float16)
        outb16 = torch.empty(n, dtype=torch.bfloat16)
        out32 = torch.empty(n, dtype=torch.float32)
        k = math.ceil(0.01 * n)
        ops = {
            "fp16_cast": lambda: out16.copy_(x),
            "fp16_cast_alloc": lambda: x.half(),
            "bf16_cast": lambda: outb16.copy_(x),
            "bf16_cast_alloc": lambda: x.bfloat16(),
            "fp16_to_float": lambda: out32.copy_(h),
            "fp16_to_float_alloc": lambda: h.float(),
            "bf16_to_float": lambda: out32.copy_(b),
            "topk_1pct": lambda: torch.topk(x.abs(), k, sorted=False),
            "topk_1pct_sorted": lambda: torch.topk(x.abs(), k),
        }
        if not args.no_kthvalue:
            ops["kthvalue_1pct"] = lambda: torch.kthvalue(x.abs(), n - k + 1)
        for op, fn in ops.items():
            median = time_op(fn, repeats)
            print(json.dumps({"impl": "torch", "version": torch.__version__, "op": op,
                              "size": name, "count": n, "repeats": repeats,
                              "median_s": median, "gbps": n * 4 / median / 1e9}),
                  flush=True)
        del x, h, b, out16, outb16, out32
    return 0


if __name__ == "__main__":
    sys.exit(main())
