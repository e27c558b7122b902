#!/usr/bin/python3
"""The table bench/torch/convergence.sh prints: for each configuration, the final test
accuracy (mean over the seeds, min-max), and its difference from float32 without a hook (the
configuration named float32) in percentage points: the mean over the seeds both ran, and
seed by seed.

  bench/torch/convergence_summary.py DIR
"""

import glob
import json
import os
import statistics
import sys
from collections import defaultdict


def main(directory):
    runs = defaultdict(dict)  # configuration -> {seed: accuracy}
    for path in sorted(glob.glob(os.path.join(directory, "*~*.json"))):
        config, seed = os.path.basename(path)[:-len(".json")].rsplit("~", 1)
        with open(path) as f:
            runs[config][int(seed)] = 100 * json.load(f)["test_accuracy"]
    if not runs:
        sys.exit("convergence_summary.py: no runs in " + directory)
    seeds = sorted({s for r in runs.values() for s in r})
    base = runs.get("float32", {})
    print("| configuration | test accuracy (mean, min-max) | vs float32 (points) | seed by seed |")
    print("|:---|---:|---:|:---|")
    for config in sorted(runs, key=lambda c: (c != "float32", c)):
        by_seed = runs[config]
        values = list(by_seed.values())
        mean = statistics.mean(values)
        cell = f"{mean:.2f}% ({min(values):.2f}-{max(values):.2f})"
        paired = [s for s in seeds if s in by_seed and s in base]
        if config == "float32" or not paired:
            print(f"| {config} | {cell} | | |")
            continue
        deltas = [by_seed[s] - base[s] for s in paired]
        print(f"| {config} | {cell} | {statistics.mean(deltas):+.2f} | " +
              ", ".join(f"{d:+.2f}" for d in deltas) + " |")

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
