#!/usr/bin/python3
"""PyTorch DDP against DDP + ZeroRedundancyOptimizer on the trainer's MLP: the torch peer of
bench/train/strategies.sh's ddp and zero1, run by bench/peers/torch_zero.sh.

784-2048-2048-2048-2048-10 (14.2 M parameters, torch's default init), AdamW (lr 1e-3),
batch 64 per rank of Fashion-MNIST-shaped random data (neither step time nor memory depends
on the pixels), one thread per rank, gloo on CPU. --strategy ddp: DDP (25 MB buckets) and
torch.optim.AdamW; zero1: the same DDP and ZeroRedundancyOptimizer(AdamW), which keeps the
AdamW state of its share of the parameters and broadcasts the updated ones after its step.
Plain, not overlap_with_ddp: torch 1.13's ddp_zero_hook refuses any backend but NCCL/HCCL.

A step is zero_grad, forward, backward and optimizer step, timed on each rank without a
barrier; a step's time is the slowest rank's, step_s their median. Rank 0 writes --json:
optimizer_state_bytes_per_rank is the fullest rank's (by_rank lists them all: torch shards by
whole tensors, greedily, so the ranks hold unequal shares), peak_rss_bytes the largest rank's,
approx_bytes_sent_per_rank the growth of the loopback counters over the timed steps over the
ranks (gloo's TCP between local ranks, packet headers included, plus anything else on lo).

  /usr/bin/python3 -m torch.distributed.run --standalone --nproc_per_node 4 --redirects 1 \\
      --tee 1 --log_dir /tmp/torchrun-logs bench/peers/torch_zero_mlp.py --strategy zero1 \\
      --json /tmp/zero1.json
"""
import argparse
import json
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from torch_ddp_mlp import mlp  # the same model as the DDP comparison (this script's folder)


def lo_sent_bytes():
    # Local ranks talk over the loopback device, even through the host's own address.
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                return int(counters.split()[8])  # transmit bytes
    return 0


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--strategy", default="ddp", choices=["ddp", "zero1"])
    p.add_argument("--steps", type=int, default=12, help="timed steps (12)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (2)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank (64)")
    p.add_argument("--hidden", default="2048,2048,2048,2048")
    p.add_argument("--json", help="rank 0 writes the results here")
    a = p.parse_args()
    torch.set_num_threads(1)  # the ranks are the parallelism, as in gradsync-train
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    model = nn.parallel.DistributedDataParallel(mlp(a.hidden), bucket_cap_mb=25)
    if a.strategy == "ddp":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                      lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.rand(a.batch, 784, generator=g)
    y = torch.randint(0, 10, (a.batch,), generator=g)
    times = []
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            dist.barrier()  # outside the timed steps: all ranks start counting bytes together
            sent0 = lo_sent_bytes()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
    dist.barrier()
    sent = lo_sent_bytes() - sent0
    # ZeroRedundancyOptimizer's own .state is empty; its shard's state is its local optim's.
    local = opt.optim if a.strategy == "zero1" else opt
    state = sum(tensor_bytes(s.values()) for s in local.state.values())
    params = list(model.parameters())
    by_rank = torch.zeros(world, dtype=torch.float64)
    by_rank[rank] = state
    dist.all_reduce(by_rank)
    step_max = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(step_max, op=dist.ReduceOp.MAX)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024],
                       dtype=torch.float64)  # Linux reports KiB
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        out = {"impl": "torch-" + a.strategy, "strategy": a.strategy, "ranks": world,
               "steps": a.steps, "step_s": statistics.median(step_max.tolist()),
               # AdamW's state appears at its first step, so after warm-up it is all there.
               "optimizer_state_bytes_per_rank": int(by_rank.max()),
               "optimizer_state_bytes_by_rank": [int(b) for b in by_rank],
               "parameter_bytes_per_rank": tensor_bytes(params),
               # Only the .grad tensors: DDP's flat buckets (gradient_as_bucket_view=False,
               # the default) hold another copy, which only peak RSS sees.
               "gradient_bytes_per_rank": tensor_bytes(q.grad for q in params),
               "peak_rss_bytes": int(rss[0]), "approx_bytes_sent_per_rank": sent // world,
               "parameters": sum(q.numel() for q in params), "torch": torch.__version__}
        print(json.dumps(out), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
