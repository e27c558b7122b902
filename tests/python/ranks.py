"""Runs a test body on N ranks: N fresh processes (spawned, as torchrun starts them), each
with its process group initialised, and collects what each returns or raises.

    results = ranks.run(4, body, "gradsync", arg)   # body(rank, world, arg) on every rank

A rank that raises fails the test with that rank's traceback; a rank still running after
`hang_s` is killed and named (a guard against hangs, not a measurement).
"""
import multiprocessing
import os
import socket
import traceback

DEFAULT_HANG_S = 240


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world, port, backend, init, body, args, queue, env, settle):
    os.environ.update(env)
    try:
        if backend == "numpy":  # the numpy level alone: gradsync.init() reads these
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port))
            queue.put((rank, True, body(rank, world, *args)))
            return
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if backend == "gradsync" or backend == "gradsync-numpy":
            import gradsync.torch  # noqa: F401  registers the backend
        if backend == "gradsync-numpy":
            result = body(rank, world, *args)
        else:
            if init == "env":
                os.environ.update(RANK=str(rank), WORLD_SIZE=str(world),
                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                dist.init_process_group(backend)
            elif init.startswith("file://"):
                dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
            else:
                dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}",
                                        rank=rank, world_size=world)
            result = body(rank, world, *args)
            # Rank 0 hosts torch's store: it must not leave while another rank may still
            # poll it (new_group's store-based barrier does). Not after a failure on purpose.
            if settle:
                dist.barrier()
                dist.destroy_process_group()
        # A tensor crosses the queue through shared memory that dies with this process:
        # send its values.
        if isinstance(result, torch.Tensor):
            result = result.numpy()
        queue.put((rank, True, result))
    except BaseException as e:  # noqa: B902  every failure goes back to the parent
        queue.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run(world, body, backend="gradsync", *args, init="tcp", env=None, hang_s=DEFAULT_HANG_S,
        expect_failure=False, dies=()):
    """backend: a torch.distributed backend ("gradsync", "gloo"), or "numpy" (no torch: the
    body calls gradsync.init(), which finds RANK, WORLD_SIZE and MASTER_* set), or
    "gradsync-numpy" (torch imported, no process group). Returns [result of rank 0, ...,
    rank world-1]. With expect_failure, returns
    {rank: error text or result} of every rank but those in `dies` (ranks that kill
    themselves, whose outcome is never reported)."""
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
        for _ in range(world - len(dies)):
            rank, ok, value = queue.get(timeout=hang_s)
            outcomes[rank] = (ok, value)
    except Exception:
        missing = sorted(set(range(world)) - set(outcomes) - set(dies))
        raise AssertionError(f"ranks {missing} did not finish within {hang_s} s "
                             f"(outcomes so far: {outcomes})")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if expect_failure:
        return {r: v for r, (ok, v) in outcomes.items()}
    failed = {r: v for r, (ok, v) in outcomes.items() if not ok}
    assert not failed, "ranks failed:\n" + "\n".join(f"rank {r}: {v}" for r, v in failed.items())
    return [outcomes[r][1] for r in range(world)]
