#!/usr/bin/python3
"""Times PyTorch DDP training steps of the MLP: gradsync's c10d backend against gloo.

The model, hooks and process-group set-up are examples/torch/train.py's own (imported), so
this times what that example trains: 784-2048x4-10 (14.2 M parameters, --width/--depth),
SGD with momentum 0.9, batch 64 per rank of random Fashion-MNIST-shaped data (a step's time
does not depend on the pixels), one thread per rank. A step is zero_grad, forward,
backward (DDP's all-reduces overlap it) and the optimizer step. Reported: the slowest
rank's median over --steps steps after --warmup.

  /usr/bin/python3 -m torch.distributed.run --standalone --nproc_per_node 2 --redirects 1 \\
      --tee 1 --log_dir /tmp/torchrun-logs bench/torch/ddp_step.py --backend gloo --hook fp16
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "examples", "torch"))
import train  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="gradsync", choices=["gradsync", "gloo"])
    p.add_argument("--hook", default="none", metavar="SPEC",
                   help=f"as train.py's: torch's {train.TORCH_HOOKS}, else a gradsync codec; "
                        "or nocomm, nocomm:fp16: no communication, the floor of any backend's step")
    p.add_argument("--steps", type=int, default=30, help="timed steps (30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (5)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank (64)")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="as train.py's")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", metavar="FILE", help="rank 0 writes the result to FILE")
    a = p.parse_args()
    if min(a.steps, a.batch, a.width, a.depth) < 1 or a.warmup < 0:
        p.error("--steps, --batch, --width, --depth >= 1 and --warmup >= 0")
    return a


class Bench:
    """The DDP model, its optimizer and one rank's fixed batch."""

    def __init__(self, args, rank, make_hook):
        torch.manual_seed(args.seed)
        module = train.mlp(args.width, args.depth)
        self.parameters = sum(p.numel() for p in module.parameters())
        self.model = DDP(module, bucket_cap_mb=train.bucket_cap_mb(args))
        hook = make_hook()
        if hook is not None:
            self.model.register_comm_hook(*hook)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data, as in DDP
        self.x = torch.rand(args.batch, 1, 28, 28, generator=g)
        self.y = torch.randint(0, 10, (args.batch,), generator=g)

    def step(self):
        self.optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(self.model(self.x), self.y).backward()
        self.optimizer.step()

    def release(self):
        self.model = self.optimizer = None


def no_communication(spec):
    """A hook that does no communication: 'nocomm' divides the bucket by the world size, as
    DDP's built-in all-reduce does, and hands it back: the step that no backend can beat
    (same compute, same ranks sharing the cores);
    'nocomm:fp16' does the tensor work of torch's fp16_compress_hook (to float16, divide,
    copy back) without its all_reduce, the floor of that hook on any backend."""
    if spec not in ("nocomm", "nocomm:fp16"):
        train.fail(f"--hook {spec}: the no-communication hooks are nocomm and nocomm:fp16")

    def hook(state, bucket):
        done = torch.futures.Future()
        world = dist.get_world_size()
        if spec == "nocomm":
            done.set_result(bucket.buffer().div_(world))
            return done
        done.set_result([bucket.buffer().to(torch.float16).div_(world)])
        return done.then(lambda fut: bucket.buffer().copy_(fut.value()[0]))
    return lambda: (None, hook)


def timed_steps(bench, steps, warmup):
    """The slowest rank's median step, in seconds."""
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        bench.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    median = torch.tensor([statistics.median(times)], dtype=torch.float32)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median.item())


def main():
    args = parse_args()
    torch.set_num_threads(1)  # one thread per rank: the ranks share the machine's cores
    # a bad --hook fails before the rendezvous
    make_hook = (no_communication(args.hook) if args.hook.startswith("nocomm")
                 else train.parse_hook(args.hook))
    rank, world = train.init_distributed(args.backend)
    bench = Bench(args, rank, make_hook)
    seconds = timed_steps(bench, args.steps, args.warmup)
    if rank == 0:
        print(f"ddp_step: {args.backend}, {world} ranks, hook {args.hook}, mlp "
              f"{args.width}x{args.depth} ({bench.parameters} parameters), batch {args.batch}: "
              f"median step {1000 * seconds:.2f} ms over {args.steps} steps", flush=True)
        if args.json:
            train.write_json(args.json, dict(
                backend=args.backend, world_size=world, hook=args.hook, step_s=seconds,
                steps=args.steps, warmup=args.warmup, batch=args.batch, width=args.width,
                depth=args.depth, parameters=bench.parameters,
                bucket_cap_mb=train.bucket_cap_mb(args), torch=torch.__version__))
    train.close(bench.release)


if __name__ == "__main__":
    main()
