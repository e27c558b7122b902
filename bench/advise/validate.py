#!/usr/bin/env python3
"""gradsync-advise's predictions against gradsync-train's measured steps, configuration by
configuration, on this machine and on network-namespace clusters (scripts/netns-cluster.sh).

For every cluster shape (ranks, hosts, link rate) it first runs gradsync-probe there, then
for each configuration of that shape: gradsync-train for --steps optimizer steps (the median
step after the first --warmup, from rank 0's wall clock) and gradsync-advise on the probe's
profile. Prints predicted against measured, the error of each, the median and largest
absolute error, and whether the configuration the advisor ranks first among each group's
candidates is within 5% of the group's fastest measured one.

  bench/advise/validate.py [--build build] [--steps 30] [--warmup 5] [--only SUBSTRING]
                           [--json FILE]

Needs root for the clusters of several hosts. Holds /tmp/gradsync-bench.lock, as the other
benchmarks do, so that no two measure at once.
"""

import argparse
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (group, ranks, hosts, link rate, gradsync-train flags). A group's members are the candidates
# among which the advisor should pick the fastest: same model, batch and cluster.
CONFIGS = [
    ("mlp-2", 2, 1, None, "--model mlp"),
    ("mlp-2", 2, 1, None, "--model mlp --no-overlap"),
    ("mlp-2", 2, 1, None, "--model mlp --bucket-mb 4"),
    ("mlp-2", 2, 1, None, "--model mlp --codec fp16"),
    ("mlp-2", 2, 1, None, "--model mlp --codec int8"),
    ("mlp-2", 2, 1, None, "--model mlp --bucket-mb 1"),
    ("mlp-2z", 2, 1, None, "--model mlp --zero 1"),
    ("mlp-2z", 2, 1, None, "--model mlp --zero 2"),
    ("mlp-2z", 2, 1, None, "--model mlp --zero 3"),
    ("mlp-2a", 2, 1, None, "--model mlp --accumulate 4"),
    ("mlp-4", 4, 1, None, "--model mlp"),
    ("mlp-4", 4, 1, None, "--model mlp --codec bf16"),
    ("mlp-4", 4, 1, None, "--model mlp --bucket-mb 100"),
    ("cnn-2", 2, 1, None, "--model cnn"),
    ("cnn-2", 2, 1, None, "--model cnn --bucket-mb 1 --first-bucket-mb 0.25"),
    ("cnn-4", 4, 1, None, "--model cnn"),
    ("mlp-8", 8, 1, None, "--model mlp --hidden 1024,1024"),
    ("mlp-8", 8, 1, None, "--model mlp --hidden 1024,1024 --codec fp16"),
    ("mlp-2h", 2, 2, "1gbit", "--model mlp"),
    ("mlp-2h", 2, 2, "1gbit", "--model mlp --codec fp16"),
    ("mlp-2h", 2, 2, "1gbit", "--model mlp --codec int8"),
    ("mlp-2h", 2, 2, "1gbit", "--model mlp --codec topk:ratio=0.01"),
    ("mlp-2h", 2, 2, "1gbit", "--model mlp --codec powersgd:rank=4"),
    ("mlp-4h", 4, 4, "1gbit", "--model mlp"),
    ("mlp-4h", 4, 4, "1gbit", "--model mlp --codec int8"),
    ("mlp-4h100", 4, 4, "100mbit", "--model mlp --hidden 256,256"),
    ("mlp-4h100", 4, 4, "100mbit", "--model mlp --hidden 256,256 --codec int8"),
    ("mlp-4h10g", 4, 2, "10gbit", "--model mlp"),
    ("mlp-4h10g", 4, 2, "10gbit", "--model mlp --codec bf16"),
    ("mlp-4hz", 4, 2, "1gbit", "--model mlp --optimizer adamw"),
    ("mlp-4hz", 4, 2, "1gbit", "--model mlp --optimizer adamw --zero 1"),
    ("mlp-4hz", 4, 2, "1gbit", "--model mlp --optimizer adamw --zero 2"),
    ("mlp-4hz", 4, 2, "1gbit", "--model mlp --optimizer adamw --zero 3"),
    ("mlp28-4h", 4, 2, "1gbit", "--model mlp --hidden 4096,4096,2048"),
    ("mlp28-4h", 4, 2, "1gbit", "--model mlp --hidden 4096,4096,2048 --codec int8"),
    ("mlp28-4h", 4, 2, "1gbit", "--model mlp --hidden 4096,4096,2048 --codec topk:ratio=0.01"),
    ("mlp28-4ha", 4, 2, "1gbit", "--model mlp --hidden 4096,4096,2048 --accumulate 4"),
]


def flag(flags, name, default):
    words = flags.split()
    return words[words.index(name) + 1] if name in words else default


class Cluster:
    """Runs one command per host: plain gradsync-run on this machine, or one gradsync-run in
    each network namespace of a shaped cluster."""

    def __init__(self, build, ranks, hosts, rate):
        self.build, self.ranks, self.hosts, self.rate = build, ranks, hosts, rate
        self.script = os.path.join(ROOT, "scripts", "netns-cluster.sh")
        self.prefix = "ga"
        self.port = 29800

    def __enter__(self):
        if self.hosts > 1:
            subprocess.run([self.script, "up", "--prefix", self.prefix, "--hosts",
                            str(self.hosts), "--rate", self.rate], check=True,
                           stdout=subprocess.DEVNULL)
            self.master = subprocess.run([self.script, "addr", "--prefix", self.prefix, "0"],
                                         check=True, capture_output=True,
                                         text=True).stdout.strip()
        return self

    def __exit__(self, *exc):
        if self.hosts > 1:
            subprocess.run([self.script, "down", "--prefix", self.prefix],
                           stdout=subprocess.DEVNULL)

    def run(self, argv, log):
        run = os.path.join(self.build, "tools", "gradsync-run")
        if self.hosts == 1:
            cmds = [[run, "-n", str(self.ranks), "--timeout-s", "600", "--"] + argv]
        else:
            self.port += 1
            per_host = self.ranks // self.hosts
            cmds = [[self.script, "exec", "--prefix", self.prefix, str(h), run, "--nnodes",
                     str(self.hosts), "--node-rank", str(h), "-n", str(per_host),
                     "--master-addr", self.master, "--master-port", str(self.port),
                     "--timeout-s", "600", "--"] + argv for h in range(self.hosts)]
        with open(log, "w") as out:
            procs = [subprocess.Popen(c, stdout=out, stderr=subprocess.STDOUT) for c in cmds]
            codes = [p.wait() for p in procs]
        if any(codes):
            sys.exit(f"validate: {' '.join(argv)} failed ({codes}); log: {log}")


def median_step(report, warmup):
    wall = report["wall_at_step"]
    steps = [b - a for a, b in zip(wall, wall[1:])][warmup:]
    return statistics.median(steps)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--only", default="", help="configurations whose group contains this")
    p.add_argument("--json", help="write the table as JSON to FILE")
    a = p.parse_args()
    lock = open("/tmp/gradsync-bench.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    work = tempfile.mkdtemp(prefix="advise_validate.")
    train = os.path.join(a.build, "examples", "gradsync-train")
    probe = os.path.join(a.build, "examples", "gradsync-probe")
    advise = os.path.join(a.build, "tools", "gradsync-advise")
    rows = []
    shapes = []
    for c in CONFIGS:
        if a.only in c[0] and c[1:4] not in shapes:
            shapes.append(c[1:4])
    for ranks, hosts, rate in shapes:
        with Cluster(a.build, ranks, hosts, rate) as cluster:
            profiles = {}
            for group, r, h, rt, flags in CONFIGS:
                if (r, h, rt) != (ranks, hosts, rate) or a.only not in group:
                    continue
                model = ["--model", flag(flags, "--model", "mlp")]
                if "--hidden" in flags:
                    model += ["--hidden", flag(flags, "--hidden", "")]
                key = "-".join(model[1::2])
                if key not in profiles:
                    profiles[key] = os.path.join(work, f"profile-{ranks}-{hosts}-{key}.json")
                    cluster.run([probe] + model + ["--json", profiles[key]],
                                profiles[key] + ".log")
                report = os.path.join(work, f"train-{len(rows)}.json")
                cluster.run([train, "--quiet", "--max-steps", str(a.steps + a.warmup + 1),
                             "--json", report] + flags.split(), report + ".log")
                measured = median_step(json.load(open(report)), a.warmup)
                predicted_file = os.path.join(work, f"advise-{len(rows)}.json")
                subprocess.run([advise, "--profile", profiles[key], "--ranks", str(ranks),
                                "--hosts", str(hosts), "--json", predicted_file] + flags.split(),
                               check=True, stdout=subprocess.DEVNULL)
                predicted = json.load(open(predicted_file))["predicted"]["step_s"]
                accumulate = int(flag(flags, "--accumulate", "1"))
                rows.append(dict(group=group, ranks=ranks, hosts=hosts, rate=rate or "-",
                                 flags=flags, measured_s=measured, predicted_s=predicted,
                                 error=predicted / measured - 1, accumulate=accumulate))
                print(f"{group:<10} {ranks}r {hosts}h {rate or '-':>7}  {flags:<52} "
                      f"measured {measured * 1e3:8.1f} ms  predicted {predicted * 1e3:8.1f} ms  "
                      f"{100 * rows[-1]['error']:+6.1f}%", flush=True)
    errors = [abs(r["error"]) for r in rows]
    print(f"\n{len(rows)} configurations: median absolute error "
          f"{100 * statistics.median(errors):.1f}%, largest {100 * max(errors):.1f}%")
    groups = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r)
    hits = 0
    for g, members in groups.items():
        per_sample = lambda r, key: r[key] / r["accumulate"]  # noqa: E731
        best = min(members, key=lambda r: per_sample(r, "measured_s"))
        chosen = min(members, key=lambda r: per_sample(r, "predicted_s"))
        ok = per_sample(chosen, "measured_s") <= 1.05 * per_sample(best, "measured_s")
        hits += ok
        print(f"{g:<10} fastest measured: {best['flags']}; predicted fastest: "
              f"{chosen['flags']} ({'within 5%' if ok else 'NOT within 5%'})")
    print(f"the predicted fastest within 5% of the measured fastest in {hits} of {len(groups)} "
          f"groups")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
