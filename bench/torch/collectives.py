#!/usr/bin/python3
"""Times torch.distributed collectives on float32 tensors: gradsync's c10d backend or gloo.

For each --op and each of --sizes: --warmup untimed calls, then --iters timed one by one;
a rank's time is the median of its calls, the op's the slowest rank's. Reported per op and
size: that time, algorithm bandwidth (bytes / t) and bus bandwidth (algbw times the share
of the data each rank must move, as nccl-tests counts it: 2(n-1)/n for all_reduce,
(n-1)/n for the gathers, scatters and all_to_all, 1 for broadcast), so that numbers for
different world sizes compare against a link's speed.

Sizes are the bytes of the whole buffer one rank holds: all_reduce's and broadcast's
tensor, all_gather's output (each rank contributes 1/n), reduce_scatter's input (each rank
keeps 1/n), all_to_all_single's input; rounded down to a whole float32 per rank.

Before an op is timed it runs once on values whose result is known and is checked. A
backend that lacks the op (gloo 1.13: all_gather_into_tensor, reduce_scatter) is reported
"unsupported", one that raises anything else "error", a result that differs "wrong":
never a crash, the other ops still run.

  /usr/bin/python3 -m torch.distributed.run --standalone --nproc_per_node 4 --redirects 1 \\
      --tee 1 --log_dir /tmp/torchrun-logs bench/torch/collectives.py --backend gloo --op all
"""

import argparse
import os
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "examples", "torch"))
import train  # noqa: E402  the same process-group set-up as the example

OPS = ["all_reduce", "broadcast", "all_gather_into_tensor", "all_gather", "reduce_scatter",
       "all_to_all_single"]
UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1000, "m": 1 << 20,
         "mib": 1 << 20, "mb": 10 ** 6, "g": 1 << 30, "gib": 1 << 30, "gb": 10 ** 9}


def parse_size(text):
    """'4KiB' -> 4096, '64MiB', '1M' (binary), '1MB' (decimal), '512' (bytes)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size like 4KiB, 64MiB or 1000")
    return int(m.group(1)) * UNITS[m.group(2).lower()]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="gradsync", choices=["gradsync", "gloo"])
    p.add_argument("--op", default="all_reduce",
                   help=f"comma-separated, or 'all': {', '.join(OPS)} (default all_reduce)")
    p.add_argument("--sizes", default="4KiB,64MiB", help="comma-separated (default 4KiB,64MiB)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size (20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls first (5)")
    p.add_argument("--json", metavar="FILE", help="rank 0 writes the results to FILE")
    a = p.parse_args()
    a.ops = OPS if a.op == "all" else [o.strip() for o in a.op.split(",") if o.strip()]
    for op in a.ops:
        if op not in OPS:
            p.error(f"--op {op}: not one of {', '.join(OPS)}")
    try:
        a.sizes = [parse_size(s) for s in a.sizes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as e:
        p.error(f"--sizes: {e}")
    if a.iters < 1 or a.warmup < 0 or not a.sizes or min(a.sizes) < 4:
        p.error("--iters >= 1, --warmup >= 0, and sizes of at least 4 bytes")
    return a


# ---------------------------------------------------------------------------------------
# The ops: each builds its buffers once, and gives the call to time and a check of the
# result of one call on the values it was built with (rank r holds r + 1, or for
# all_to_all_single a value that names the sending rank and chunk).


class Op:
    busbw_factor = 1.0

    def __init__(self, count, rank, world):
        self.count, self.rank, self.world = count, rank, world
        self.chunk = count // world

    def zero(self):
        """Timed calls run on zeros: repeated sums would otherwise grow to inf, and a
        backend's speed on non-finite values is not what is being measured."""
        for t in self.tensors():
            t.zero_()


class AllReduce(Op):
    def __init__(self, count, rank, world):
        super().__init__(count, rank, world)
        self.busbw_factor = 2 * (world - 1) / world
        self.x = torch.full((count,), float(rank + 1))

    def tensors(self):
        return [self.x]

    def __call__(self):
        dist.all_reduce(self.x)

    def correct(self):
        return bool((self.x == self.world * (self.world + 1) / 2).all())


class Broadcast(Op):
    def __init__(self, count, rank, world):
        super().__init__(count, rank, world)
        self.x = torch.full((count,), float(rank + 1))

    def tensors(self):
        return [self.x]

    def __call__(self):
        dist.broadcast(self.x, src=0)

    def correct(self):
        return bool((self.x == 1.0).all())


class AllGatherIntoTensor(Op):
    def __init__(self, count, rank, world):
        super().__init__(count, rank, world)
        self.busbw_factor = (world - 1) / world
        self.x = torch.full((self.chunk,), float(rank + 1))
        self.out = torch.zeros(self.chunk * world)
        # torch 1.13 added the public name; before it the same op was _all_gather_base.
        self.fn = getattr(dist, "all_gather_into_tensor", None) or dist._all_gather_base

    def tensors(self):
        return [self.x, self.out]

    def __call__(self):
        self.fn(self.out, self.x)

    def correct(self):
        expected = torch.arange(1, self.world + 1, dtype=torch.float32)
        return bool((self.out.view(self.world, -1) == expected[:, None]).all())


class AllGather(AllGatherIntoTensor):
    """The list form, which every backend of torch's has (gloo's only all-gather)."""

    def __init__(self, count, rank, world):
        super().__init__(count, rank, world)
        self.outs = list(self.out.view(world, -1).unbind(0))

    def __call__(self):
        dist.all_gather(self.outs, self.x)


class ReduceScatter(Op):
    def __init__(self, count, rank, world):
        super().__init__(count, rank, world)
        self.busbw_factor = (world - 1) / world
        self.x = torch.full((self.chunk * world,), float(rank + 1))
        self.out = torch.zeros(self.chunk)
        # torch 1.13 added reduce_scatter_tensor; before it the op was _reduce_scatter_base.
        self.fn = getattr(dist, "reduce_scatter_tensor", None) or dist._reduce_scatter_base

    def tensors(self):
        return [self.x, self.out]

    def __call__(self):
        self.fn(self.out, self.x)

    def correct(self):
        return bool((self.out == self.world * (self.world + 1) / 2).all())


class AllToAllSingle(Op):
    def __init__(self, count, rank, world):
        super().__init__(count, rank, world)
        self.busbw_factor = (world - 1) / world
        # Chunk j of rank r's input holds r * world + j: it should land as chunk r of j.
        ids = torch.arange(world, dtype=torch.float32) + rank * world
        self.x = ids.repeat_interleave(self.chunk)
        self.out = torch.zeros(self.chunk * world)

    def tensors(self):
        return [self.x, self.out]

    def __call__(self):
        dist.all_to_all_single(self.out, self.x)

    def correct(self):
        expected = torch.arange(self.world, dtype=torch.float32) * self.world + self.rank
        return bool((self.out.view(self.world, -1) == expected[:, None]).all())


OP_CLASSES = {"all_reduce": AllReduce, "broadcast": Broadcast,
              "all_gather_into_tensor": AllGatherIntoTensor, "all_gather": AllGather,
              "reduce_scatter": ReduceScatter, "all_to_all_single": AllToAllSingle}
UNSUPPORTED = re.compile(r"not support|no support|unsupported|not implemented", re.IGNORECASE)


# ---------------------------------------------------------------------------------------
# Measuring


def agree(code):
    """The worst of every rank's status code (0 ok, 1 wrong, 2 error, 3 unsupported), so
    that all ranks time an op, or none does."""
    t = torch.tensor([float(code)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def try_once(op):
    """(status code, message) of one checked call."""
    try:
        op()
    except (RuntimeError, NotImplementedError, AttributeError, TypeError, ValueError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return (3 if UNSUPPORTED.search(message) else 2), message
    return (0, "") if op.correct() else (1, "result differs from the expected values")


def time_op(op, iters, warmup):
    """The slowest rank's median seconds per call."""
    op.zero()
    for _ in range(warmup):
        op()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        op()
        times.append(time.perf_counter() - t0)
    median = torch.tensor([statistics.median(times)], dtype=torch.float32)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median.item())


def measure(name, size, args, rank, world):
    count = (size // 4 // world) * world  # whole float32s, a whole chunk per rank
    record = dict(op=name, bytes=count * 4, requested_bytes=size, status="ok")
    if count == 0:
        return dict(record, status="too small", message=f"fewer than {world} floats")
    op = OP_CLASSES[name](count, rank, world)
    code, message = try_once(op)
    code = agree(code)
    if code:
        status = {1: "wrong", 2: "error", 3: "unsupported"}[code]
        return dict(record, status=status, message=message or "on another rank")
    seconds = time_op(op, args.iters, args.warmup)
    algbw = record["bytes"] / seconds / 1e9
    return dict(record, median_s=seconds, algbw_gbps=algbw,
                busbw_gbps=algbw * op.busbw_factor)


def print_row(r):
    if r["status"] != "ok":
        print(f"{r['op']:<24}{r['bytes']:>12}  {r['status']}: {r.get('message', '')}",
              flush=True)
        return
    print(f"{r['op']:<24}{r['bytes']:>12}{1e6 * r['median_s']:>14.1f}"
          f"{r['algbw_gbps']:>12.3f}{r['busbw_gbps']:>12.3f}", flush=True)


def main():
    args = parse_args()
    torch.set_num_threads(1)  # one thread per rank: the ranks share the machine's cores
    rank, world = train.init_distributed(args.backend)
    if rank == 0:
        print(f"# {args.backend}, {world} ranks, torch {torch.__version__}, median of "
              f"{args.iters} calls after {args.warmup}, slowest rank", flush=True)
        print(f"{'op':<24}{'bytes':>12}{'median_us':>14}{'algbw_GB/s':>12}{'busbw_GB/s':>12}",
              flush=True)
    results = []
    for name in args.ops:
        for size in args.sizes:
            results.append(measure(name, size, args, rank, world))
            if rank == 0:
                print_row(results[-1])
    if rank == 0 and args.json:
        train.write_json(args.json, dict(
            backend=args.backend, world_size=world, torch=torch.__version__, iters=args.iters,
            warmup=args.warmup, results=results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
