#!/usr/bin/python3
"""The table bench/torch/convergence.sh prints: for each configuration, the final test
accuracy of each seed, their mean, and the mean's difference from float32 without a hook
(the configuration named float32), in percentage points.

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
    base = statistics.mean(runs["float32"].values()) if runs.get("float32") else None
    print("| configuration | " + " | ".join(f"seed {s}" for s in seeds) +
          " | mean | vs float32 (points) |")
    print("|---" * (len(seeds) + 3) + "|")
    for config, by_seed in runs.items():
        cells = [f"{by_seed[s]:.2f}" if s in by_seed else "-" for s in seeds]
        mean = statistics.mean(by_seed.values())
        delta = "-" if base is None or config == "float32" else f"{mean - base:+.2f}"
        print(f"| {config} | " + " | ".join(cells) + f" | {mean:.2f} | {delta} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
