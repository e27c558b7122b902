#!/usr/bin/python3
"""PyTorch DDP on the trainer's MLP, the peer of gradsync-train in bench/peers/ddp_compare.sh.

784-2048-2048-2048-2048-10 (14.2 M parameters), SGD with momentum 0.9, batch 64 per rank of
Fashion-MNIST-shaped random data (step time does not depend on the pixels), one thread per
rank, gloo backend. --hook none | fp16 (fp16_compress_hook) | powersgd (powerSGD_hook,
matrix_approximation_rank 4, as gradsync's powersgd:rank=4). World size 1 runs the plain
model without DDP: the single-process baseline of scaling efficiency.

Run: /usr/bin/python3 -m torch.distributed.run --nproc_per_node N torch_ddp_mlp.py ...
     (or directly for one process). Rank 0 prints one JSON line:
     {"impl": "torch-ddp", "ranks": N, "hook": ..., "step_s": median, "steps": ...}
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def mlp(hidden):
    """gradsync-train's MLP: 784 -> hidden ("2048,2048,...") -> 10, ReLU between layers."""
    widths = [784] + [int(w) for w in hidden.split(",")] + [10]
    layers = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i + 2 < len(widths):
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hook", default="none", choices=["none", "fp16", "powersgd"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--hidden", default="2048,2048,2048,2048")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP bucket cap (default 25; powersgd: one bucket, see below)")
    a = p.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(1)
    model = mlp(a.hidden)
    if world > 1:
        dist.init_process_group("gloo")
        # torch 1.13's PowerSGD hook over gloo aborts ("op.preamble.length <= op.nbytes")
        # when two buckets' hooks run their all-reduces concurrently on one process group;
        # with the whole model in one bucket they run one after the other.
        cap = a.bucket_cap_mb if a.bucket_cap_mb is not None else (
            1000.0 if a.hook == "powersgd" else 25.0)
        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
        if a.hook == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif a.hook == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                                start_powerSGD_iter=2)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.rand(a.batch, 784, generator=g)
    y = torch.randint(0, 10, (a.batch,), generator=g)
    times = []
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
    # The slowest rank's median defines the step.
    med = torch.tensor([statistics.median(times)])
    if world > 1:
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(json.dumps({"impl": "torch-ddp", "ranks": world, "hook": a.hook,
                          "step_s": float(med[0]), "steps": a.steps, "parameters": params,
                          "torch": torch.__version__}), flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
