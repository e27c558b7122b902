#!/usr/bin/python3
"""The table bench/torch/run.sh prints: medians over repetitions, gradsync against gloo.

Reads every *.json that collectives.py and ddp_step.py wrote into DIR (their content says
which backend, world size, op, size or hook each is). A cell is the median over the
repetitions of the slowest rank's median time; `gradsync/gloo` is the ratio of those
times (below 1: gradsync faster). Missing or unsupported cells print as '-' or the status.

  bench/torch/summarize.py DIR
"""

import glob
import json
import os
import statistics
import sys
from collections import defaultdict

BACKENDS = ("gloo", "gradsync")


def load(directory):
    """(collective rows, ddp_step rows), each a dict keyed by what identifies a cell, of
    {backend: [seconds of each repetition] or a status string}."""
    coll, steps, shape = defaultdict(dict), defaultdict(dict), None
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        with open(path) as f:
            d = json.load(f)
        if "results" in d:  # collectives.py
            for r in d["results"]:
                cell = coll[(r["op"], d["world_size"], r["bytes"])]
                if r["status"] == "ok":
                    times = cell.setdefault(d["backend"], [])
                    if isinstance(times, list):
                        times.append((r["median_s"], r["busbw_gbps"]))
                else:
                    cell.setdefault(d["backend"], r["status"])
        elif "step_s" in d:  # ddp_step.py
            steps[(d["hook"], d["world_size"])].setdefault(d["backend"], []).append(d["step_s"])
            shape = f"mlp {d['width']}x{d['depth']}, {d['parameters']} parameters, " \
                    f"batch {d['batch']} per rank"
    return coll, steps, shape


def median_of(cell, backend, index=None):
    v = cell.get(backend)
    if not isinstance(v, list) or not v:
        return v  # None (not run) or a status such as "unsupported"
    return statistics.median(x[index] if index is not None else x for x in v)


def fmt(v, scale, digits):
    if v is None:
        return "-"
    return v if isinstance(v, str) else f"{v * scale:.{digits}f}"


def ratio(cell, index=None):
    a, b = median_of(cell, "gradsync", index), median_of(cell, "gloo", index)
    return f"{a / b:.3f}" if isinstance(a, float) and isinstance(b, float) and b > 0 else "-"


def print_collectives(coll):
    if not coll:
        return
    print("collectives: median over repetitions of the slowest rank's median call")
    print(f"{'op':<24}{'ranks':>6}{'bytes':>12}{'gloo_us':>12}{'gradsync_us':>13}"
          f"{'gradsync/gloo':>15}{'gloo_busbw':>12}{'gradsync_busbw':>16}")
    for (op, ranks, size), cell in sorted(coll.items(), key=lambda kv: kv[0]):
        print(f"{op:<24}{ranks:>6}{size:>12}"
              f"{fmt(median_of(cell, 'gloo', 0), 1e6, 1):>12}"
              f"{fmt(median_of(cell, 'gradsync', 0), 1e6, 1):>13}{ratio(cell, 0):>15}"
              f"{fmt(median_of(cell, 'gloo', 1), 1, 3):>12}"
              f"{fmt(median_of(cell, 'gradsync', 1), 1, 3):>16}")
    print("(busbw in GB/s)")


def print_steps(steps, shape):
    if not steps:
        return
    print(f"ddp_step ({shape}): median over repetitions of the slowest rank's median step")
    print(f"{'hook':<24}{'ranks':>6}{'gloo_ms':>12}{'gradsync_ms':>13}{'gradsync/gloo':>15}"
          f"{'repeats':>9}")
    for (hook, ranks), cell in sorted(steps.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        runs = "/".join(str(len(cell.get(b, []))) for b in BACKENDS)
        print(f"{hook:<24}{ranks:>6}{fmt(median_of(cell, 'gloo'), 1e3, 2):>12}"
              f"{fmt(median_of(cell, 'gradsync'), 1e3, 2):>13}{ratio(cell):>15}{runs:>9}")


def main():
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit(__doc__.strip().splitlines()[-1].strip())
    coll, steps, shape = load(sys.argv[1])
    print_collectives(coll)
    if coll and steps:
        print()
    print_steps(steps, shape)


if __name__ == "__main__":
    main()
