#!/usr/bin/env python3
"""gradsync-advise's predictions on the shipped GPU profiles (profiles/*.json) against
published measurements (bench/advise/published.json, each with its source):

- nccl-tests all_reduce bus bandwidth: gradsync-advise --collective allreduce --bytes B;
- data-parallel scaling: the model's layers from torchvision (gradsync.torch.workload, FLOPs
  per layer), its one-GPU step from the published one-GPU throughput (spread over the layers
  by their FLOPs, backward twice forward), then gradsync-advise --layers on N GPUs; the
  prediction is N x batch / the predicted step, against the published N-GPU throughput.

Both price NCCL's ring (--algo ring), the algorithm those runs used; the collective rows also
show what gradsync itself would pick.

The profiles' figures come from specifications and from measurements other than these
(point-to-point rates, NIC rates): none is fitted to the rows it is compared with.

  PYTHONPATH=build/python /usr/bin/python3 bench/advise/published.py [--build build]
      [--json FILE]

Needs torchvision (python3-torchvision). Pure arithmetic: it runs no rank, so it may run
beside a benchmark.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def advise(build, *flags):
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([os.path.join(build, "tools", "gradsync-advise"), *flags, "--json", out.name],
                       check=True, capture_output=True, text=True)
        return json.load(open(out.name))


def profile_path(name):
    return os.path.join(ROOT, "profiles", name + ".json")


def model_flops(name):
    """Per-sample FLOPs of each layer of a torchvision model, forward order."""
    import torch
    import torchvision
    import gradsync.torch

    if name == "inception_v3":
        net, size = torchvision.models.inception_v3(aux_logits=False, init_weights=False), 299
    else:
        net, size = getattr(torchvision.models, name)(), 224
    torch.manual_seed(0)
    return gradsync.torch.workload(net.eval(), torch.randn(1, 3, size, size), timed=False,
                                   repeats=1, name=name)


def timed_workload(flops, batch, step_s):
    """The workload with each layer's ms: `step_s` spread over the layers by their FLOPs."""
    total = sum(l["forward_flops"] + l["backward_flops"] for l in flops["layers"])
    w = {"name": flops["name"], "batch": batch, "optimizer": "sgd", "layers": []}
    for l in flops["layers"]:
        layer = dict(l)
        layer["forward_ms"] = step_s * 1e3 * l["forward_flops"] / total
        layer["backward_ms"] = step_s * 1e3 * l["backward_flops"] / total
        w["layers"].append(layer)
    return w


def training_row(build, row, models):
    if row["model"] not in models:
        models[row["model"]] = model_flops(row["model"])
    flops = models[row["model"]]
    profile = profile_path(row["profile"])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "w.json")
        # The published one-GPU step holds the optimizer's step too: compute is the rest.
        json.dump(timed_workload(flops, row["batch"], 1.0), open(path, "w"))
        optimizer_s = advise(build, "--layers", path, "--profile", profile, "--ranks", "1")[
            "predicted"]["optimizer_s"]
        one_step_s = row["batch"] / row["one_gpu_per_s"]
        json.dump(timed_workload(flops, row["batch"], one_step_s - optimizer_s), open(path, "w"))
        out = advise(build, "--layers", path, "--profile", profile, "--ranks", str(row["ranks"]),
                     "--hosts", str(row["hosts"]), "--algo", row["algo"], *row["plan"].split())
    predicted = row["ranks"] * row["batch"] / out["predicted"]["step_s"]
    return predicted, out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--json", help="write the table as JSON to FILE")
    a = p.parse_args()
    data = json.load(open(os.path.join(ROOT, "bench", "advise", "published.json")))
    rows = []

    print("nccl-tests all_reduce bus bandwidth, GB/s: published; predicted for NCCL's "
          "algorithm; predicted for gradsync's pick")
    for r in data["collectives"]:
        def busbw(algo):
            out = advise(a.build, "--profile", profile_path(r["profile"]), "--collective",
                         r["collective"], "--ranks", str(r["ranks"]), "--hosts",
                         str(r["hosts"]), "--bytes", str(r["bytes"]), "--algo", algo)
            return out["sizes"][0]
        predicted = busbw(r["algo"])["busbw_gbps"]
        gradsync = busbw("auto")
        error = predicted / r["busbw_gbps"] - 1
        rows.append({"kind": "collective", "what": r["what"], "profile": r["profile"],
                     "published": r["busbw_gbps"], "predicted": predicted, "error": error,
                     "algorithm": r["algo"], "gradsync_busbw": gradsync["busbw_gbps"],
                     "gradsync_algorithm": gradsync["algorithm"],
                     "excluded": r.get("excluded", ""), "source": r["source"]})
        print(f"  {r['what']:<70} {r['busbw_gbps']:8.2f} {predicted:8.2f} {100 * error:+6.1f}%"
              f" ({r['algo']})  {gradsync['busbw_gbps']:8.2f} ({gradsync['algorithm']})"
              + (f"  [not counted: {r['excluded']}]" if r.get("excluded") else ""))

    print("data-parallel throughput on N GPUs, samples/s")
    models = {}
    for r in data["training"]:
        predicted, out = training_row(a.build, r, models)
        error = predicted / r["per_s"] - 1
        efficiency = predicted / (r["ranks"] * r["one_gpu_per_s"])
        rows.append({"kind": "training", "what": r["what"], "profile": r["profile"],
                     "published": r["per_s"], "predicted": predicted, "error": error,
                     "published_efficiency": r["per_s"] / (r["ranks"] * r["one_gpu_per_s"]),
                     "predicted_efficiency": efficiency, "bottleneck": out["bottleneck"],
                     "exposed_comm_s": out["predicted"]["exposed_comm_s"],
                     "step_s": out["predicted"]["step_s"], "excluded": r.get("excluded", ""),
                     "source": r["source"]})
        print(f"  {r['what']:<70} published {r['per_s']:9.0f}  predicted {predicted:9.0f}"
              f"  {100 * error:+6.1f}%  efficiency {100 * rows[-1]['published_efficiency']:.0f}%"
              f" vs {100 * efficiency:.0f}% ({out['bottleneck']})")

    counted = [abs(r["error"]) for r in rows if not r["excluded"]]
    print(f"{len(counted)} rows counted: median |error| {100 * statistics.median(counted):.1f}%, "
          f"largest {100 * max(counted):.1f}%, within 20%: "
          f"{sum(e <= 0.2 for e in counted)} of {len(counted)}")
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
