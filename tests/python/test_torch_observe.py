"""Observability from Python: gradsync.torch.stats() per training step, and one timeline
holding torch's steps and gradsync's calls."""
import json
import os
import subprocess

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ranks


def train(rank, world, steps=6):
    import gradsync.torch
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 2048), torch.nn.ReLU(),
                              torch.nn.Linear(2048, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    ddp = DDP(net, bucket_cap_mb=0.5)  # 2.6 MB of gradients: several buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(steps):
        ddp(torch.randn(16, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    per_step = gradsync.torch.stats()
    params = sum(p.numel() for p in net.parameters())
    written = gradsync.torch.write_timeline()
    return per_step, params, written


def test_stats_give_each_steps_communication():
    # The ring, whose bytes are known: left to the cost model, a call may take the shared-memory
    # all-reduce instead, which sends no messages.
    for per_step, params, _ in ranks.run(2, train, env={"GRADSYNC_ALGO": "ring"}):
        assert len(per_step) == 5, per_step  # six forwards: five finished steps
        for s in per_step:
            # One bucket before DDP rebuilds its buckets after the first step; then several.
            assert s["calls"] >= (1 if s["step"] == 1 else 2), s
            assert 0 < s["comm_s"] and 0 <= s["exposed_s"] <= s["step_s"], s
            # A ring all-reduce sends (n-1)/n of the gradient twice: params x 4 bytes at n=2.
            assert 0.9 * params * 4 <= s["bytes"] <= 1.5 * params * 4, (s, params)


def test_the_timeline_holds_torchs_steps_and_gradsyncs_calls(tmp_path):
    path = tmp_path / "trace.json"
    results = ranks.run(2, train, env={"GRADSYNC_TIMELINE": str(path)})
    assert results[0][2] > 0 and results[1][2] == 0
    events = json.loads(path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {(e.get("pid"), e.get("cat"), e.get("name", "").split(" ")[0]) for e in events}
    for rank in (0, 1):
        for span in (("step", "step"), ("compute", "forward"), ("compute", "backward"),
                     ("comm", "ALLREDUCE")):
            assert (rank, *span) in names, (span, sorted(names)[:20])
    # Each backward lies inside its step, after its forward.
    spans = {(e["pid"], e["name"]): (e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("ph") == "X"}
    for (rank, name), (start, end) in spans.items():
        # The last forward's step has no span: it ends at a forward that never came.
        if name.startswith("backward ") and (rank, "step " + name.split()[1]) in spans:
            step = spans[(rank, "step " + name.split()[1])]
            forward = spans[(rank, "forward " + name.split()[1])]
            assert step[0] <= forward[0] <= forward[1] <= start <= end <= step[1], name
    # gradsync-advise reads it: five steps after the six forwards, two of them warm-up.
    out = subprocess.run([os.path.join(os.environ["GRADSYNC_BUILD_DIR"], "tools",
                                       "gradsync-advise"), "--trace", str(path)],
                         capture_output=True, text=True, check=True).stdout
    assert "PyTorch, 2 ranks, 5 steps" in out and "buckets (median all-reduce): #0" in out, out
