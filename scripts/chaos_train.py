#!/usr/bin/python3
"""Training runs that lose a rank: each run kills one rank (SIGKILL, as kill -9) at a step
chosen by the seed, and gradsync-run either restarts every rank (--max-restarts) or goes on
with one rank fewer (--min-ranks); gradsync-train resumes from its latest checkpoint. Mode
"link" (root: network namespaces) runs one rank per namespace host, each host with its own
gradsync-run, and takes a host's link down at a time chosen by the seed: the launchers'
rendezvous loses that host and the others go on without it (--min-nodes).

Checked for every run: the job completes (exit 0); a restarted run ends with the model of the
uninterrupted run, bit for bit (its final checkpoint file is byte for byte the same); a shrunk
run (shrink, link) ends with a test accuracy between the two sizes': from the lowest of
--reference-seeds uninterrupted runs at the smaller size (trainer seeds 1, 2, ...) up to the
highest of those and the full size's run, widened by --tolerance points on each side (a run
that fails late has trained at the full size almost throughout); nothing of the job is left
in /dev/shm; no process of the job outlives it.
Reported: the time each failure cost (the run's wall time minus the uninterrupted run's).
--trainer-flags passes more flags to every run (e.g. "--zero 3 --optimizer adamw": ZeRO's
shards are re-sharded when the job shrinks).

  /usr/bin/python3 scripts/chaos_train.py --build build --runs 20 --seed 1

Exit status 0 if every run passed every check, 1 otherwise.
"""
import argparse
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

CLUSTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netns-cluster.sh")

# Algorithms chosen by a fixed cost model, so that a resumed run (which takes it from the
# checkpoint) and the uninterrupted one sum in the same order.
PINNED = "alpha_us=500,bandwidth_gbps=0.5,reduce_gbps=1,shm_call_us=100000"


def shm_entries():
    return {n for n in os.listdir("/dev/shm") if n.startswith(("gradsync-", "ucx_"))}


def processes_naming(text):
    """Pids of processes whose command line contains `text` (this run's unique directory)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


class Job:
    def __init__(self, args, work):
        self.args, self.work = args, work

    def train(self, out, seed=1):
        a = self.args
        return [os.path.join(a.build, "examples/gradsync-train"), "--hidden", str(a.hidden),
                "--max-steps", str(a.steps), "--checkpoint-every", str(a.checkpoint_every),
                "--lr-scaling", "linear", "--codec", a.codec, "--quiet",
                "--checkpoint", out + "/ckpt", "--json", out + "/report.json",
                "--seed", str(seed), *shlex.split(a.trainer_flags)]

    def run(self, name, ranks, extra_launcher=(), kill=None, seed=1):
        """Runs gradsync-train under gradsync-run; returns (exit code, seconds, report, dir)."""
        a = self.args
        out = os.path.join(self.work, name)
        env = dict(os.environ, GRADSYNC_COST_MODEL=PINNED, GRADSYNC_QUIET="1")
        train = self.train(out, seed)
        command = [os.path.join(a.build, "tools/gradsync-run"), "-n", str(ranks), "--no-prefix",
                   *extra_launcher, "--"]
        if kill:
            # Only the first attempt loses the rank; the restarted one runs through.
            rank, step = kill
            command += ["sh", "-c",
                        'if [ "$GRADSYNC_RESTART_COUNT" = 0 ]; then '
                        f'export GRADSYNC_TRAIN_KILL_AT_STEP={rank}:{step}; fi; exec "$@"', "sh"]
        os.makedirs(out)
        start = time.monotonic()
        done = subprocess.run(command + train, env=env, capture_output=True, text=True)
        seconds = time.monotonic() - start
        report = None
        if done.returncode == 0:
            with open(out + "/report.json") as f:
                report = json.load(f)
        return done, seconds, report, out


    def run_across_hosts(self, name, hosts, victim, cut_at_step):
        """One rank on each of `hosts` namespace hosts, each under its own gradsync-run
        (--max-restarts 1 --min-nodes hosts-1); host `victim`'s link goes down once the
        checkpoint of `cut_at_step` is written. Returns (host 0's run, every host's exit code,
        seconds, report, dir)."""
        a = self.args
        out = os.path.join(self.work, name)
        os.makedirs(out)
        prefix = "ct%d" % (os.getpid() % 100000)
        up = subprocess.run([CLUSTER, "up", "--prefix", prefix, "--hosts", str(hosts)],
                            capture_output=True, text=True)
        if up.returncode != 0:
            raise SystemExit("chaos_train: cannot make the namespace hosts: " + up.stderr)
        try:
            env = dict(os.environ, GRADSYNC_COST_MODEL=PINNED, GRADSYNC_QUIET="1",
                       GRADSYNC_TCP_LIVENESS_S="3", GRADSYNC_TOKEN=uuid.uuid4().hex)
            procs = []
            start = time.monotonic()
            for h in range(hosts):
                launcher = [os.path.join(a.build, "tools/gradsync-run"), "--no-prefix",
                            "--nnodes", str(hosts), "--node-rank", str(h), "-n", "1",
                            "--master-addr", "10.77.0.10", "--master-port", "29590",
                            "--max-restarts", "1", "--min-nodes", str(hosts - 1), "--"]
                procs.append(subprocess.Popen(
                    [CLUSTER, "exec", "--prefix", prefix, str(h)] + launcher + self.train(out),
                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            latest = os.path.join(out, "ckpt/LATEST")
            while procs[0].poll() is None:
                try:
                    with open(latest) as f:
                        if int(f.read().strip() or 0) >= cut_at_step:
                            break
                except (OSError, ValueError):
                    pass
                time.sleep(0.005)
            subprocess.run(["ip", "-n", f"{prefix}-h{victim}", "link", "set", "eth0", "down"],
                           check=True)
            outputs = [p.communicate()[0] for p in procs]
            seconds = time.monotonic() - start
        finally:
            subprocess.run([CLUSTER, "down", "--prefix", prefix], capture_output=True)
        codes = [p.returncode for p in procs]
        report = None
        if codes[0] == 0:
            with open(out + "/report.json") as f:
                report = json.load(f)
        host0 = subprocess.CompletedProcess(procs[0].args, codes[0], outputs[0], outputs[0])
        return host0, codes, seconds, report, out


def final_checkpoint(directory, rank=0):
    with open(os.path.join(directory, "ckpt/LATEST")) as f:
        step = f.read().strip()
    with open(os.path.join(directory, f"ckpt/step-{step}.rank-{rank}.ckpt"), "rb") as f:
        return step, f.read()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", default="build")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=60, help="--max-steps of every run")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--codec", default="none")
    p.add_argument("--mode", choices=["restart", "shrink", "link", "mixed"], default="mixed",
                   help="mixed: restart and shrink in turn, and link as every third as root")
    p.add_argument("--reference-seeds", type=int, default=3,
                   help="uninterrupted runs at the smaller size, each with its own seed")
    p.add_argument("--tolerance", type=float, default=0.5,
                   help="test accuracy points a shrunk run may lie outside their range")
    p.add_argument("--trainer-flags", default="", help="more flags for gradsync-train")
    p.add_argument("--json", help="write every run's result here")
    a = p.parse_args()
    rng = random.Random(a.seed)
    work = tempfile.mkdtemp(prefix="gradsync-chaos-train-")
    job = Job(a, work)
    shm_before = shm_entries()
    failures = []

    def check(ok, what):
        if not ok:
            failures.append(what)
            print("  FAIL:", what, flush=True)
        return ok

    # The references: uninterrupted runs at the full size and one rank fewer.
    done, full_s, full_report, full_dir = job.run("reference-full", a.ranks)
    check(done.returncode == 0, f"reference run at {a.ranks} ranks: {done.stderr[-2000:]}")
    small_accs = []
    for seed in range(1, a.reference_seeds + 1):
        done, seconds, report, _ = job.run(f"reference-small-{seed}", a.ranks - 1, seed=seed)
        check(done.returncode == 0,
              f"reference run at {a.ranks - 1} ranks, seed {seed}: {done.stderr[-2000:]}")
        if done.returncode == 0:
            small_accs.append(100 * report["test_accuracy"])
            if seed == 1:
                small_s, small_acc = seconds, small_accs[-1]
    if failures:
        return 1
    full_step, full_model = final_checkpoint(full_dir)
    full_acc = 100 * full_report["test_accuracy"]
    # A shrunk run trains at the full size until the failure and at the smaller size after it:
    # its accuracy lies between the two sizes' (a late failure ends near the full size's).
    low = min(small_accs) - a.tolerance
    high = max(small_accs + [full_acc]) + a.tolerance
    print(f"reference: {a.ranks} ranks {full_s:.1f} s, accuracy {full_acc:.2f}%; "
          f"{a.ranks - 1} ranks {small_s:.1f} s, accuracy "
          f"{', '.join(f'{x:.2f}' for x in small_accs)}% over seeds 1-{a.reference_seeds} "
          f"(a shrunk run passes within {low:.2f}-{high:.2f}%)", flush=True)

    modes = ["restart", "shrink"] + (["link"] if os.geteuid() == 0 else [])
    results = []
    for run in range(a.runs):
        mode = a.mode if a.mode != "mixed" else modes[run % len(modes)]
        victim, step = rng.randrange(a.ranks), rng.randrange(1, a.steps)
        name = f"run-{run:02d}-{mode}"
        if mode == "link":
            # Host 0 holds the launchers' rendezvous (it cannot be lost); the cut follows a
            # checkpoint before the last.
            victim = 1 + rng.randrange(a.ranks - 1)
            step = a.checkpoint_every * rng.randrange(1, max(2, a.steps // a.checkpoint_every))
            done, codes, seconds, report, out = job.run_across_hosts(name, a.ranks, victim, step)
            result = {"run": run, "mode": mode, "victim": victim, "step": step,
                      "seconds": seconds, "exit": done.returncode, "exits": codes}
            print(f"{name}: cut host {victim}'s link after step {step}: exits {codes}, "
                  f"{seconds:.1f} s", flush=True)
            check(all(c == 0 for h, c in enumerate(codes) if h != victim),
                  f"{name}: a host that kept its link failed: {codes}: {done.stdout[-2000:]}")
            check(codes[victim] != 0, f"{name}: the cut-off host's launcher exited 0")
        else:
            launcher = ["--max-restarts", "1"] + (["--min-ranks", str(a.ranks - 1)]
                                                  if mode == "shrink" else [])
            done, seconds, report, out = job.run(name, a.ranks, launcher, (victim, step))
            result = {"run": run, "mode": mode, "victim": victim, "step": step,
                      "seconds": seconds, "exit": done.returncode}
            print(f"{name}: kill rank {victim} at step {step}: exit {done.returncode}, "
                  f"{seconds:.1f} s", flush=True)
        if check(done.returncode == 0, f"{name} exited {done.returncode}: {done.stderr[-2000:]}"):
            check("restarting every rank" in done.stderr, f"{name}: no restart in the log")
            acc = 100 * report["test_accuracy"]
            result["accuracy"] = acc
            if mode == "restart":
                result["cost_s"] = seconds - full_s
                got_step, model = final_checkpoint(out)
                check(got_step == full_step and model == full_model,
                      f"{name}: final checkpoint differs from the uninterrupted run's")
            else:  # shrink, link: the job ends at the smaller size
                result["cost_s"] = seconds - small_s
                check(low <= acc <= high,
                      f"{name}: accuracy {acc:.2f}% outside {low:.2f}-{high:.2f}% (runs at "
                      f"{a.ranks - 1} ranks over {a.reference_seeds} seeds up to the one at "
                      f"{a.ranks}, +-{a.tolerance})")
        # Every process of the job is gone once the launcher returned.
        strays = processes_naming(out)
        check(not strays, f"{name}: processes left: {strays}")
        left = shm_entries() - shm_before
        check(not left, f"{name}: left in /dev/shm: {sorted(left)}")
        results.append(result)
        shutil.rmtree(out, ignore_errors=True)

    for mode in ("restart", "shrink", "link"):
        costs = [r["cost_s"] for r in results if r["mode"] == mode and "cost_s" in r]
        if costs:
            print(f"{mode}: {len(costs)} runs, time a failure cost: median {statistics.median(costs):.1f} s "
                  f"(min {min(costs):.1f}, max {max(costs):.1f})")
    print(f"{a.runs} runs, {len(failures)} failed check(s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"reference": {"ranks": a.ranks, "seconds": full_s, "accuracy": full_acc,
                                     "smaller_seconds": small_s, "smaller_accuracy": small_acc,
                                     "smaller_accuracies": small_accs,
                                     "shrunk_accepted": [low, high]},
                       "runs": results, "failures": failures}, f, indent=1)
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
