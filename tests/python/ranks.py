"""Runs a test body on N ranks: N fresh processes (spawned, as torchrun starts them), each
with its process group initialised, and collects what each returns or raises.

    results = ranks.run(4, body, "gradsync", arg)   # body(rank, world, arg) on every rank

A rank that raises fails the test with that rank's traceback; a rank still running after
`hang_s` is killed and named (a guard against hangs, not a measurement).

Bodies that are expected to succeed, on a torch backend initialised over tcp with no extra
environment, run on a pool: the same N processes, their process group kept, serve body after
body (a barrier between two), as one job runs step after step. Starting N interpreters that
import torch costs seconds, more than most bodies. A pool whose body failed or hung is killed,
and the next body gets fresh processes.
"""
import atexit
import multiprocessing
import os
import random
import socket
import sys
import traceback

DEFAULT_HANG_S = 240


def free_port():
    """A port free now outside the kernel's ephemeral range, as gradsync-run picks one
    (src/rendezvous/unused_port.h): a port the kernel hands out for port 0 can be taken by
    another test's connection or listener before rank 0 binds it."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(v) for v in f.read().split())
    candidates = [*range(10000, low), *range(high + 1, 65536)]
    for port in random.sample(candidates, min(64, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("", port))
                return port
            except OSError:
                continue
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank, world, port, backend, init, env):
    """The rank's set-up before its body: environment, torch, the process group."""
    os.environ.update(env)
    if backend == "numpy":  # the numpy level alone: gradsync.init() reads these
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        return
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "gradsync" or backend == "gradsync-numpy":
        import gradsync.torch  # noqa: F401  registers the backend
    if backend == "gradsync-numpy":
        return
    if init == "env":
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        dist.init_process_group(backend)
    elif init.startswith("file://"):
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)


def _settle(backend):
    """Rank 0 hosts torch's store: it must not leave while another rank may still poll it
    (new_group's store-based barrier does)."""
    if backend in ("numpy", "gradsync-numpy"):
        return
    import torch.distributed as dist
    dist.barrier()


def _sendable(result):
    # A tensor crosses the queue through shared memory that dies with this process: send its
    # values.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(result, torch.Tensor):
        return result.numpy()
    return result


def _failure(e):
    return f"{type(e).__name__}: {e}\n{traceback.format_exc()}"


def _child(rank, world, port, backend, init, body, args, queue, env, settle):
    try:
        _init(rank, world, port, backend, init, env)
        result = body(rank, world, *args)
        # Not after a failure on purpose.
        if settle:
            _settle(backend)
            if backend not in ("numpy", "gradsync-numpy"):
                import torch.distributed as dist
                dist.destroy_process_group()
        queue.put((rank, True, _sendable(result)))
    except BaseException as e:  # noqa: B902  every failure goes back to the parent
        queue.put((rank, False, _failure(e)))


def _serve(rank, world, port, backend, inbox, outbox):
    """A pool's rank: set up once, then run each body it is sent; None ends it."""
    try:
        _init(rank, world, port, backend, "tcp", {})
    except BaseException as e:  # noqa: B902
        outbox.put((rank, False, _failure(e)))
        return
    import torch.distributed as dist
    while True:
        job = inbox.get()
        if job is None:
            dist.barrier()
            dist.destroy_process_group()
            return
        body, args = job
        try:
            result = body(rank, world, *args)
            dist.barrier()
            outbox.put((rank, True, _sendable(result)))
        except BaseException as e:  # noqa: B902  the pool is discarded after a failure
            outbox.put((rank, False, _failure(e)))
            return


def _collect(queue, expected, hang_s, outcomes, until_failure=False):
    """Fills outcomes with what `expected` ranks report; False if one is missing after hang_s.
    until_failure: stop at the first failure (the other ranks may be waiting for it)."""
    try:
        for _ in range(expected):
            rank, ok, value = queue.get(timeout=hang_s)
            outcomes[rank] = (ok, value)
            if until_failure and not ok:
                return True
    except Exception:
        return False
    return True


def _stop(procs, grace_s):
    for p in procs:
        p.join(timeout=grace_s)
        if p.is_alive():
            p.kill()
            p.join()


class _Pool:
    def __init__(self, world, backend):
        ctx = multiprocessing.get_context("spawn")
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.outbox = ctx.Queue()
        port = free_port()
        self.procs = [ctx.Process(target=_serve,
                                  args=(r, world, port, backend, self.inboxes[r], self.outbox))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, body, args, hang_s):
        for inbox in self.inboxes:
            inbox.put((body, args))
        outcomes = {}
        finished = _collect(self.outbox, len(self.procs), hang_s, outcomes, until_failure=True)
        return finished, outcomes

    def close(self, kill=False):
        if not kill:
            for inbox in self.inboxes:
                inbox.put(None)
        _stop(self.procs, 0 if kill else 30)


_pools = {}  # (world, backend) -> _Pool, the most recently used last
_MAX_POOLS = 3  # idle interpreters with torch loaded hold memory: keep a few


def _pool(world, backend):
    key = (world, backend)
    pool = _pools.pop(key, None) or _Pool(world, backend)
    _pools[key] = pool
    while len(_pools) > _MAX_POOLS:
        _pools.pop(next(iter(_pools))).close()
    return pool


@atexit.register
def _close_pools():
    while _pools:
        _pools.popitem()[1].close()


def _result(world, outcomes):
    failed = {r: v for r, (ok, v) in outcomes.items() if not ok}
    assert not failed, "ranks failed:\n" + "\n".join(f"rank {r}: {v}" for r, v in failed.items())
    return [outcomes[r][1] for r in range(world)]


def run(world, body, backend="gradsync", *args, init="tcp", env=None, hang_s=DEFAULT_HANG_S,
        expect_failure=False, dies=()):
    """backend: a torch.distributed backend ("gradsync", "gloo"), or "numpy" (no torch: the
    body calls gradsync.init(), which finds RANK, WORLD_SIZE and MASTER_* set), or
    "gradsync-numpy" (torch imported, no process group). Returns [result of rank 0, ...,
    rank world-1]. With expect_failure, returns
    {rank: error text or result} of every rank but those in `dies` (ranks that kill
    themselves, whose outcome is never reported)."""
    if not expect_failure and not env and init == "tcp" and backend in ("gradsync", "gloo"):
        pool = _pool(world, backend)
        finished, outcomes = pool.run(body, args, hang_s)
        failed = not all(ok for ok, _ in outcomes.values())
        if not finished or failed:
            _pools.pop((world, backend)).close(kill=True)
        if failed:
            return _result(world, outcomes)
        if not finished:
            missing = sorted(set(range(world)) - set(outcomes))
            raise AssertionError(f"ranks {missing} did not finish within {hang_s} s "
                                 f"(outcomes so far: {outcomes})")
        return _result(world, outcomes)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child,
                         args=(r, world, port, backend, init, body, args, queue, env or {},
                               not expect_failure))
             for r in range(world)]
    for p in procs:
        p.start()
    outcomes = {}
    try:
        if not _collect(queue, world - len(dies), hang_s, outcomes):
            missing = sorted(set(range(world)) - set(outcomes) - set(dies))
            raise AssertionError(f"ranks {missing} did not finish within {hang_s} s "
                                 f"(outcomes so far: {outcomes})")
    finally:
        _stop(procs, 30)
    if expect_failure:
        return {r: v for r, (ok, v) in outcomes.items()}
    return _result(world, outcomes)
