"""Seed 002's first recipe on gradsync: autocast bf16 training under DDP with gradients
communicated in bf16 (gradsync's codec, added in float32 at every hop), and fp16 with a
dynamic loss scaler whose overflow on any rank skips the step on every rank."""
import json
import os
import pathlib
import subprocess
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ranks

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("GRADSYNC_BUILD_DIR", ROOT / "build")).resolve()


def autocast_bf16(rank, world):
    import gradsync.torch
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = DDP(net, bucket_cap_mb=0.004)
    ddp.register_comm_hook(None, gradsync.torch.hooks.codec("bf16", net))
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    losses = []
    for step in range(40):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(32, 20, generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ddp(x)
            assert out.dtype == torch.bfloat16
            loss = torch.nn.functional.cross_entropy(out.float(), x[:, :4].argmax(1))
        loss.backward()
        assert all(p.grad.dtype == torch.float32 for p in net.parameters())  # master weights
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return torch.cat([p.detach().flatten() for p in net.parameters()]).numpy(), losses


def test_autocast_bf16_under_ddp_trains_with_bf16_gradients_on_the_wire():
    results = ranks.run(2, autocast_bf16)
    assert (results[0][0] == results[1][0]).all(), "ranks diverged"
    losses = results[0][1]
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses


def test_fp16_overflow_on_the_first_steps_skips_them_on_every_rank(tmp_path):
    out = tmp_path / "r.json"
    done = subprocess.run(
        [str(BUILD / "tools" / "gradsync-run"), "-n", "2", "--", sys.executable,
         str(ROOT / "examples" / "torch" / "train.py"), "--backend", "gradsync", "--model", "mlp",
         "--width", "64", "--depth", "2", "--train-limit", "512", "--test-limit", "200",
         "--batch", "32", "--no-progress", "--amp", "fp16", "--loss-scale", "1e39",
         "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    # A scale past float32's range overflows every gradient: those steps are skipped (on
    # every rank alike, or DDP's ranks would drift apart and the run would not finish
    # in step), the scale halves until it fits, and training goes on.
    assert report["skipped_steps"] >= 1 and report["steps"] > report["skipped_steps"], report
