"""Unchanged PyTorch training code over the gradsync backend: DistributedDataParallel with
its options, no_sync accumulation, ZeroRedundancyOptimizer and torch's own comm hooks, each
compared with the same run over gloo."""
import numpy
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ranks

STEPS = 20


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 10))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def train(rank, world, options, hook=None, accumulate=1, zero=False):
    net = model()
    ddp = DDP(net, **options)
    if hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                       start_powerSGD_iter=3, min_compression_rate=0.5)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(STEPS):
        for micro in range(accumulate):
            x, y = batch(rank, step * accumulate + micro)
            if micro < accumulate - 1:
                with ddp.no_sync():
                    loss_fn(ddp(x), y).backward()
            else:
                loss_fn(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().flatten() for p in net.parameters()])


CASES = {
    "default": dict(options={}),
    "small buckets": dict(options=dict(bucket_cap_mb=0.01)),
    "bucket view": dict(options=dict(bucket_cap_mb=0.01, gradient_as_bucket_view=True)),
    "static graph": dict(options=dict(static_graph=True)),
    "unused params": dict(options=dict(find_unused_parameters=True)),
    "no_sync x3": dict(options={}, accumulate=3),
    "zero": dict(options={}, zero=True),
    "fp16 hook": dict(options=dict(bucket_cap_mb=0.01), hook="fp16"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ddp_matches_gloo_and_ranks_stay_bitwise_equal(case):
    kwargs = CASES[case]
    ours = ranks.run(2, train, "gradsync", kwargs["options"], kwargs.get("hook"),
                     kwargs.get("accumulate", 1), kwargs.get("zero", False))
    theirs = ranks.run(2, train, "gloo", kwargs["options"], kwargs.get("hook"),
                       kwargs.get("accumulate", 1), kwargs.get("zero", False))
    assert (ours[0] == ours[1]).all(), "ranks diverged"
    # Sums of two float32 values round alike in any order; more ranks may round apart.
    numpy.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-6)


def test_powersgd_hook_runs_with_many_buckets():
    # torch's PowerSGD over gloo aborts once a model has more than one bucket (its allreduce
    # of P and Q runs inside a future callback); over gradsync it trains.
    params = ranks.run(3, train, "gradsync", dict(bucket_cap_mb=0.005), "powersgd")
    assert (params[0] == params[1]).all() and (params[1] == params[2]).all()
    assert numpy.isfinite(params[0]).all()
