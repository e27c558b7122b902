#!/usr/bin/env python3
"""Throws randomised mistakes at gradsync's tools, as a careless user or a hostile neighbour
would: bad environment variables, bad flags, bad files, junk connections. Reports every case
that hung, crashed, exited 0 although it could not do what was asked, failed without naming
what was wrong, or failed only by running into its timeout.

usage: scripts/chaos.py [--build DIR] [--cases N] [--seed S] [--hang-s S] [--keep]
                        [--only env|flag|data|output|checkpoint|connection|launch]...
Exit status: 0 when every case behaved, 1 otherwise. Standard library only.
"""
import argparse
import gzip
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

DATA = "/usr/share/datasets/fashion-mnist"
# A failing case must end by naming the mistake, long before this deadline (ms) runs out:
# an error that mentions a timeout means the tool waited instead of checking.
TIMEOUT_MS = 20000
CRASH_SIGNS = ("terminate called", "Segmentation fault", "Sanitizer", "core dumped",
               "std::bad_alloc", "what():", "Aborted", "stoi", "stol", "rank -1")
# An Error of kind timeout prints "timeout: ..." or "timeout in <operation>: ...".
TIMED_OUT = re.compile(r"\btimeout( in \w+)?: ")
GARBAGE = ["abc", "-1", "1.5", "4294967296", "99999999999999999999999", " 7", "7 ", "0x10",
           "+-3", "1e3", "\u0661", "7;rm -rf /", "-0"]


# What each numeric flag accepts: integer or number, lowest, highest (None: no limit that
# the cases reach). A value inside may pass; any other must be refused naming the flag.
FLAG_RANGES = {
    "--min-bytes": ("int", 0, 1 << 30), "--max-bytes": ("int", 1, 1 << 30),
    "--factor": ("int", 2, 1 << 20), "--iters": ("int", 1, 10**6), "--warmup": ("int", 0, 10**6),
    "--root": ("int", 0, 0),  # one rank
    "--epochs": ("int", 1, 10**6), "--batch": ("int", 1, 65536), "--hidden": ("int", 1, 16384),
    "--accumulate": ("int", 1, 65536), "--zero": ("int", 0, 2), "--max-steps": ("int", 1, 10**9),
    "--seed": ("int", 0, 2**63 - 1), "--lr": ("number", 1e-300, 1000),
    "--bucket-mb": ("number", 1e-300, 4096), "--first-bucket-mb": ("number", 1e-300, 4096),
    "-n": ("int", 1, 4096), "--nnodes": ("int", 1, 1 << 20), "--node-rank": ("int", 0, 0),
    "--master-port": ("int", 1, 65535), "--timeout-s": ("number", 0, 1e8),
    "--grace-s": ("number", 0, 1e8),
}


def accepts(rule, value):
    """Whether `value`, read strictly (no spaces, signs only on numbers, no hex), is in range."""
    kind, low, high = rule
    if value != value.strip() or not value:
        return False
    try:
        x = int(value, 10) if kind == "int" else float(value)
    except ValueError:
        return False
    return x == x and low <= x <= high


class Case:
    """One mistake: the command, its environment, what must happen."""

    def __init__(self, kind, what, argv, env=None, must_name=(), may_pass=False,
                 must_pass=False, after=None, during=None, ranks=None, may_time_out=False):
        self.kind, self.what, self.argv = kind, what, argv
        self.may_time_out = may_time_out  # a timeout is the designed answer (it must name why)
        self.ranks = ranks            # processes started by hand: (argv, env) each, judged each
        self.env = env or {}
        self.must_name = must_name    # one of these must appear in the output of a failure
        self.may_pass = may_pass      # the input may be acceptable after all
        self.must_pass = must_pass    # the tool must shrug the mistake off (exit 0)
        self.after = after            # extra check on the finished case: a problem or None
        self.during = during          # runs alongside the command (junk connections)


class Chaos:
    def __init__(self, build, rng, work):
        self.rng, self.work = rng, work
        self.run = os.path.join(build, "tools/gradsync-run")
        self.bench = os.path.join(build, "tools/gradsync-bench")
        self.train = os.path.join(build, "examples/gradsync-train")
        self.serial = 0
        self.junk_made = [0]  # junk connections that reached a listener, over every case

    def tmp(self, name):
        self.serial += 1
        path = os.path.join(self.work, "%d-%s" % (self.serial, name))
        os.makedirs(path)
        return path

    def small_bench(self, *extra):
        return [self.bench, "allreduce", "--min-bytes", "4K", "--max-bytes", "16K", "--iters",
                "3", "--warmup", "1", "--check", *extra]

    def small_train(self, *extra):
        return [self.train, "--hidden", "16", "--max-steps", "2", "--quiet", *extra]

    # --- environment ----------------------------------------------------------------------
    def env_case(self):
        ranged = {  # variable: (lowest, highest or None) of what it accepts
            "GRADSYNC_TCP_LIVENESS_S": (0, None), "GRADSYNC_TCP_SOCKBUF_BYTES": (0, None),
            "GRADSYNC_TCP_SPIN_US": (0, None), "GRADSYNC_SHM_SPIN_US": (0, None),
            "GRADSYNC_TIMEOUT": (1, None), "RANK": (0, 0), "WORLD_SIZE": (1, None),
            "LOCAL_RANK": (0, 0), "LOCAL_WORLD_SIZE": (1, None), "MASTER_PORT": (1, 65535),
        }
        chosen = {"GRADSYNC_ALGO": ["foo", "RING", "ring ", "hier,ring"],
                  "GRADSYNC_TRANSPORT": ["ib", "TCP", "shm,tcp"],
                  "GRADSYNC_KERNELS_ISA": ["avx512", "SCALAR"],
                  "GRADSYNC_COST_MODEL": ["alpha_us=x", "bandwidth_gbps=-1", "nonsense"],
                  "GRADSYNC_TOPOLOGY": ["0;0", "5", "a,b", "@/nonexistent/topology",
                                        "@" + self.fifo()],
                  "MASTER_ADDR": ["nonexistent.invalid", "999.1.1.1", "-", "::::"]}
        env = {"RANK": "0", "WORLD_SIZE": "1"}
        if self.rng.random() < 0.5:
            name = self.rng.choice(sorted(ranged))
            value = self.rng.choice(GARBAGE)
            low, high = ranged[name]
            if name == "MASTER_PORT":
                env["WORLD_SIZE"] = "2"  # a port is only dialled by a second rank
            try:
                number = int(value, 10) if value.strip() == value else None
            except ValueError:
                number = None
            acceptable = number is not None and number >= low and (high is None or number <= high)
            env[name] = value
            return Case("env", "%s=%r" % (name, value), self.small_bench(), env,
                        must_name=(name,), may_pass=acceptable)
        name = self.rng.choice(sorted(chosen))
        value = self.rng.choice(chosen[name])
        env[name] = value
        if name == "MASTER_ADDR":  # only rank 1 dials it
            env.update(RANK="1", WORLD_SIZE="2")
        return Case("env", "%s=%r" % (name, value), self.small_bench(), env,
                    must_name=(name, value.strip("@")))

    def fifo(self):
        path = os.path.join(self.tmp("fifo"), "fifo")
        os.mkfifo(path)
        return path

    # --- flags ----------------------------------------------------------------------------
    def flag_case(self):
        tool = self.rng.choice(["bench", "train", "run"])
        if tool == "bench":
            numeric = ["--min-bytes", "--max-bytes", "--factor", "--iters", "--warmup", "--root"]
            words = {"--dtype": "float33", "--op": "mean", "--algo": "fastest",
                     "--codec": "topk:ratio=2", "--transport": "ib", "--non-finite": "ignore"}
            huge = ["99999999999999", "1P", "16E", "-4K", "0"]
            base = lambda *x: [self.bench, "broadcast" if "--root" in x else "allreduce",
                               "--iters", "2", "--warmup", "0", *x]
        elif tool == "train":
            numeric = ["--epochs", "--batch", "--hidden", "--bucket-mb", "--first-bucket-mb",
                       "--accumulate", "--zero", "--max-steps", "--seed", "--lr"]
            words = {"--model": "resnet", "--optimizer": "adam", "--codec": "zip",
                     "--lr-schedule": "linear", "--step-ahead": "2"}
            huge = ["99999999999", "-1", "0", "nan", "inf", "1e300"]
            base = lambda *x: self.small_train(*x)
        else:
            numeric = ["-n", "--nnodes", "--node-rank", "--master-port", "--timeout-s",
                       "--grace-s"]
            words = {}
            huge = ["99999999999", "-1", "nan"]
            base = lambda *x: [self.run, *x, "--", "/bin/true"]
        roll = self.rng.random()
        if roll < 0.1:
            flag = "--definitely-not-a-flag"
            return Case("flag", "%s %s" % (tool, flag), base(flag), must_name=(flag,))
        if roll < 0.2 and tool != "run":
            flag = self.rng.choice(numeric)  # the value left off the end of the line
            return Case("flag", "%s %s (no value)" % (tool, flag), base(flag), must_name=(flag,))
        if roll < 0.4 and words:
            flag = self.rng.choice(sorted(words))
            return Case("flag", "%s %s %s" % (tool, flag, words[flag]),
                        base(flag, words[flag]), must_name=(flag, words[flag]))
        flag = self.rng.choice(numeric)
        value = self.rng.choice(GARBAGE[:6] + huge + [""] + (["65536"] if flag == "--master-port" else []))
        return Case("flag", "%s %s %r" % (tool, flag, value), base(flag, value),
                    must_name=(flag,), may_pass=accepts(FLAG_RANGES[flag], value))

    # --- files ----------------------------------------------------------------------------
    def data_case(self):
        d = self.tmp("data")
        names = ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                 "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]
        for n in names:
            os.symlink(os.path.join(DATA, n), os.path.join(d, n))
        victim = self.rng.choice(names)
        path = os.path.join(d, victim)
        os.unlink(path)
        how = self.rng.choice(["fifo", "zero", "empty", "garbage", "truncated", "huge-count",
                               "missing", "directory", "no-items"])
        if how == "fifo":
            os.mkfifo(path)
        elif how == "zero":
            os.symlink("/dev/zero", path)
        elif how == "empty":
            open(path, "wb").close()
        elif how == "garbage":
            with open(path, "wb") as f:
                f.write(os.urandom(self.rng.randint(1, 5000)))
        elif how == "truncated":
            with open(os.path.join(DATA, victim), "rb") as f:
                data = f.read()
            with open(path, "wb") as f:
                f.write(data[: self.rng.randint(1, len(data) - 1)])
        elif how in ("huge-count", "no-items"):
            images = "images" in victim
            count = 0x7FFFFFFF if how == "huge-count" else 0
            header = struct.pack(">IIII", 0x803, count, 28, 28) if images else struct.pack(
                ">II", 0x801, count)
            with gzip.open(path, "wb") as f:
                f.write(header)
        elif how == "directory":
            os.mkdir(path)
        return Case("file", "--data with %s %s" % (how, victim),
                    self.small_train("--data", d), must_name=(victim, d))

    def output_case(self):
        target = self.rng.choice(["/proc/no/such.json", "/", self.tmp("ro") + "/missing/x.json"])
        if self.rng.random() < 0.5:
            argv = self.small_bench("--json", target)
        else:
            argv = self.small_train("--json", target)
        return Case("file", "--json %s" % target, argv, must_name=(target,))

    def checkpoint_case(self):
        d = self.tmp("ckpt")
        made = subprocess.run(self.small_train("--checkpoint", d, "--checkpoint-every", "1"),
                              env=self.environment({}), capture_output=True, timeout=120)
        if made.returncode != 0:
            return Case("file", "checkpoint set-up failed: " + made.stderr.decode()[-300:],
                        ["/bin/false"], must_name=("never",))
        before = sorted(os.listdir(d))
        files = [f for f in before if f.endswith(".ckpt")]
        how = self.rng.choice(["flip", "truncate", "latest", "batch", "seed", "codec", "new-run",
                               "model"])
        argv = self.small_train("--checkpoint", d, "--resume")
        names = (d, "checksum")  # the directory, or a file in it
        after = None
        if how == "flip":
            victim = os.path.join(d, self.rng.choice(files))
            with open(victim, "r+b") as f:
                size = os.path.getsize(victim)
                at = self.rng.randrange(size)
                f.seek(at)
                byte = f.read(1)
                f.seek(at)
                f.write(bytes([byte[0] ^ (1 << self.rng.randrange(8))]))
        elif how == "truncate":
            victim = os.path.join(d, self.rng.choice(files))
            os.truncate(victim, self.rng.randrange(os.path.getsize(victim)))
        elif how == "latest":
            with open(os.path.join(d, "LATEST"), "w") as f:
                f.write(self.rng.choice(["abc", "-1", "99999999999999999999", "", "7"]))
        elif how in ("batch", "seed", "codec", "model"):
            flag, value = {"batch": ("--batch", "32"), "seed": ("--seed", "9"),
                           "codec": ("--codec", "fp16"), "model": ("--hidden", "17")}[how]
            argv = self.small_train("--checkpoint", d, "--resume", flag, value)
            names = (flag,)
        else:  # a new run on another run's directory must not delete what it did not write
            argv = self.small_train("--checkpoint", d, "--checkpoint-every", "1")
            names = ("--resume", "--overwrite")
            after = lambda: None if sorted(os.listdir(d)) == before else (
                "the directory changed: %s -> %s" % (before, sorted(os.listdir(d))))
        return Case("file", "checkpoint %s" % how, argv, must_name=names, after=after)

    # --- connections ----------------------------------------------------------------------
    def connection_case(self):
        port = free_port()
        transport = self.rng.choice(["tcp", "shm"])
        junk = self.rng.choice(["silent", "garbage", "huge-length", "flood", "half-hello"])
        argv = [self.run, "-n", str(self.rng.choice([2, 3])), "--master-port", str(port), "--",
                self.bench, "allreduce", "--min-bytes", "4K", "--max-bytes", "1M", "--iters",
                "300", "--warmup", "2", "--check"]
        seed = self.rng.random()
        during = lambda stop: junk_connections(port, junk, stop, seed, self.junk_made)
        return Case("connection", "%s junk at the store and ranks (%s)" % (junk, transport),
                    argv, {"GRADSYNC_TRANSPORT": transport}, must_pass=True, during=during)

    # --- ranks that disagree ---------------------------------------------------------------
    def launch_case(self):
        """Ranks started by hand that disagree: each must fail naming the disagreement, at
        once, not by the timeout."""
        port = str(free_port())
        how = self.rng.choice(["world-size", "same-rank", "token", "count", "algo", "dtype"])
        n = self.rng.choice([2, 3])
        ranks = []
        for r in range(n):
            env = {"RANK": str(r), "WORLD_SIZE": str(n), "MASTER_PORT": port,
                   "GRADSYNC_TOKEN": "chaos"}
            argv = self.small_bench()
            odd = r == n - 1  # the last rank is the one that differs
            if how == "world-size" and odd:
                env["WORLD_SIZE"] = str(n + 1)
            elif how == "same-rank" and odd:
                env["RANK"] = str(n - 2)
            elif how == "token":
                env["GRADSYNC_TIMEOUT"] = "5000"  # the others wait for it this long
                if odd:
                    env["GRADSYNC_TOKEN"] = "another"
            elif how == "count" and odd:
                argv = [self.bench, "allreduce", "--min-bytes", "8K", "--max-bytes", "8K",
                        "--iters", "3", "--warmup", "1", "--check"]
            elif how == "algo":
                env["GRADSYNC_ALGO"] = "rd" if odd else "ring"
            elif how == "dtype" and odd:
                argv = argv + ["--dtype", "float64"]
            ranks.append((argv, env))
        names = {"world-size": ("WORLD_SIZE",), "same-rank": ("claim rank",),
                 "token": ("token", "GRADSYNC_TOKEN"),
                 "count": ("mismatch", "aborted", "peer lost"),
                 "algo": ("mismatch", "aborted", "peer lost"),
                 "dtype": ("mismatch", "aborted", "peer lost")}[how]
        # A connection with a wrong token cannot end the job (a stranger's could then end any
        # job): the others wait until their timeout, which names the refused rank.
        return Case("launch", "%d ranks, %s differs" % (n, how), ranks[0][0], must_name=names,
                    ranks=ranks, may_time_out=how == "token")

    def environment(self, extra):
        env = dict(os.environ)
        for k in list(env):
            if k.startswith("GRADSYNC_") or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                   "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                                   "MASTER_PORT"):
                del env[k]
        env["GRADSYNC_TIMEOUT"] = str(TIMEOUT_MS)
        env["MASTER_PORT"] = str(free_port())
        env.update(extra)
        return env

    def make(self, only):
        makers = {"env": self.env_case, "flag": self.flag_case, "data": self.data_case,
                  "output": self.output_case, "checkpoint": self.checkpoint_case,
                  "connection": self.connection_case, "launch": self.launch_case}
        if only:
            return makers[self.rng.choice(only)]()
        roll = self.rng.random()
        if roll < 0.3:
            return self.env_case()
        if roll < 0.6:
            return self.flag_case()
        if roll < 0.72:
            return self.data_case()
        if roll < 0.78:
            return self.output_case()
        if roll < 0.86:
            return self.checkpoint_case()
        if roll < 0.93:
            return self.launch_case()
        return self.connection_case()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_ports():
    """Every TCP port something listens on (from /proc/net/tcp{,6})."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A":  # LISTEN
                        ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        except OSError:
            pass
    return ports


def junk_connections(store_port, junk, stop, seed, made):
    """Until `stop` is set: connects to the store's port and to every port that started
    listening after the job began (the ranks' transports), misbehaves there, and counts the
    connections in made[0]."""
    rng = random.Random(seed)
    before = listening_ports() - {store_port}
    held = []
    while not stop.is_set():
        targets = [store_port] + sorted(listening_ports() - before - {store_port})
        for port in targets:
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=0.5)
            except OSError:
                continue
            made[0] += 1
            try:
                if junk == "garbage":
                    s.sendall(os.urandom(rng.randint(1, 4096)))
                elif junk == "huge-length":
                    s.sendall(struct.pack("<Q", 1 << 62) + b"x" * 64)
                elif junk == "half-hello":
                    s.sendall(b"GS")
            except OSError:
                pass
            held.append(s)
        if junk != "flood":
            held = held[-32:]
        elif len(held) > 400:
            held = held[-400:]
        stop.wait(0.002 if junk == "flood" else 0.01)
    for s in held:
        s.close()


def verdict(case, rc, out, seconds, hang_s):
    """None if the case behaved, else what went wrong."""
    if rc is None:
        return "hang: still running after %d s" % hang_s
    crash = next((s for s in CRASH_SIGNS if s in out), None)
    if rc < 0 or (rc >= 128 and rc != 255):
        return "crash: exit %d" % rc
    if crash:
        return "crash or raw message: output has %r" % crash
    if case.must_pass:
        if rc != 0:
            return "failed (exit %d) where it should shrug the mistake off" % rc
        if "out of bounds values: 0 OK" not in out and "--check" in case.argv:
            return "exit 0 but the results were not checked correct"
        return None
    if rc == 0:
        return None if case.may_pass else "exit 0 although it could not do what was asked"
    if TIMED_OUT.search(out) and not case.may_time_out:
        return "failed only by running into its timeout (%.0f s)" % seconds
    if case.must_name and not any(n and n in out for n in case.must_name):
        return "the error names none of %s" % (list(case.must_name),)
    return None


def run_ranks(case, chaos, hang_s):
    """A case of processes started by hand: each is judged; the first problem counts."""
    start = time.monotonic()
    procs = [subprocess.Popen(argv, env=chaos.environment(env), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True) for argv, env in case.ranks]
    results = []
    for proc in procs:
        left = max(1.0, hang_s - (time.monotonic() - start))
        try:
            out, _ = proc.communicate(timeout=left)
            results.append((proc.returncode, out.decode(errors="replace")))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            results.append((None, out.decode(errors="replace")))
    seconds = time.monotonic() - start
    problem, text = None, ""
    for r, (rc, out) in enumerate(results):
        text += "".join("[rank %d] %s\n" % (r, line) for line in out.strip().splitlines()[-2:])
        found = verdict(case, rc, out, seconds, hang_s)
        if found and not problem:
            problem = "rank %d: %s" % (r, found)
    return problem, max((rc if rc is not None else 999) for rc, _ in results), text, seconds


def run_case(case, chaos, hang_s):
    if case.ranks:
        return run_ranks(case, chaos, hang_s)
    env = chaos.environment(case.env)
    stop = threading.Event()
    helper = None
    start = time.monotonic()
    proc = subprocess.Popen(case.argv, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    if case.during:
        helper = threading.Thread(target=case.during, args=(stop,), daemon=True)
        helper.start()
    try:
        out, _ = proc.communicate(timeout=hang_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = None
    stop.set()
    if helper:
        helper.join()
    seconds = time.monotonic() - start
    text = out.decode(errors="replace")
    problem = verdict(case, rc, text, seconds, hang_s)
    if problem is None and case.after:
        problem = case.after()
    return problem, rc, text, seconds


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", default="build")
    p.add_argument("--cases", type=int, default=300)
    p.add_argument("--seed", type=int, default=int(time.time()))
    p.add_argument("--hang-s", type=int, default=60)
    p.add_argument("--keep", action="store_true", help="keep the temporary files")
    p.add_argument("--only", action="append", default=[],
                   choices=["env", "flag", "data", "output", "checkpoint", "connection", "launch"],
                   help="only this kind of mistake (repeatable)")
    args = p.parse_args()
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="gradsync-chaos-")
    chaos = Chaos(args.build, rng, work)
    print("chaos: %d cases, seed %d (rerun with --seed %d)" % (args.cases, args.seed, args.seed))
    bad, kinds = [], {}
    for i in range(args.cases):
        case = chaos.make(args.only)
        problem, rc, text, seconds = run_case(case, chaos, args.hang_s)
        kinds.setdefault(case.kind, [0, 0, 0.0])
        kinds[case.kind][0] += 1
        kinds[case.kind][2] += seconds
        if problem:
            kinds[case.kind][1] += 1
            bad.append((case, problem, rc, text))
            env = " ".join("%s=%r" % kv for kv in sorted(case.env.items()))
            print("BAD %3d %-10s %s: %s\n    %s %s\n    %s" % (
                i, case.kind, case.what, problem, env, " ".join(case.argv),
                "\n    ".join(text.strip().splitlines()[-4:])), flush=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    for kind, (n, b, seconds) in sorted(kinds.items()):
        print("chaos: %-10s %4d cases, %3d bad, %5.1f s each" % (kind, n, b, seconds / n))
    if "connection" in kinds:
        print("chaos: %d junk connections reached a listener" % chaos.junk_made[0])
    print("chaos: %d of %d cases misbehaved" % (len(bad), args.cases))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
