"""gradsync on numpy arrays: every collective, blocking and async, in place and zero-copy,
against numpy references at world sizes 1-4; the GIL released while a call waits; errors
as gradsync.Error with the C++ error's fields."""
import os
import threading
import time

import numpy as np
import pytest

import ranks

DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, np.int8, np.int16,
          np.bool_]
COUNTS = [0, 1, 7, 1000]


def contribution(rank, count, dtype, salt=0):
    return ((np.arange(count) * 3 + rank * 5 + salt) % 7).astype(dtype)


def grid(rank, world):
    import gradsync
    ctx = gradsync.init()
    assert (ctx.rank, ctx.size) == (rank, world)
    failures = []

    def check(what, got, want):
        if got.dtype != want.dtype or not np.array_equal(got, want):
            failures.append(f"{what}: got {got[:6]} want {want[:6]}")

    for dtype in DTYPES:
        for count in COUNTS:
            every = [contribution(r, count, dtype) for r in range(world)]
            for op, ref in (("sum", np.sum), ("max", np.max), ("min", np.min)):
                a = every[rank].copy()
                out = ctx.allreduce(a, op=op)
                assert out is a  # in place: the very array, written where it lies
                check(f"allreduce {op} {dtype.__name__} {count}", a,
                      ref(np.stack(every), axis=0).astype(dtype))
            a = every[rank].copy()
            w = ctx.allreduce(a, async_op=True)
            w.wait()
            check(f"allreduce async {dtype.__name__} {count}", a,
                  np.sum(np.stack(every), axis=0).astype(dtype))
            out = np.empty_like(a)
            ctx.allreduce(every[rank], out=out)
            check(f"allreduce out {dtype.__name__} {count}", out,
                  np.sum(np.stack(every), axis=0).astype(dtype))
            b = every[rank].copy()
            ctx.broadcast(b, root=world - 1)
            check(f"broadcast {dtype.__name__} {count}", b, every[world - 1])
            g = np.empty(world * count, dtype)
            ctx.allgather(every[rank], g)
            check(f"allgather {dtype.__name__} {count}", g, np.concatenate(every))
            blocks = np.concatenate([contribution(rank, count, dtype, b) for b in range(world)])
            r = np.empty(count, dtype)
            ctx.reduce_scatter(blocks, r)
            check(f"reduce_scatter {dtype.__name__} {count}", r,
                  np.sum(np.stack([contribution(q, count, dtype, rank) for q in range(world)]),
                         axis=0).astype(dtype))
            red = np.empty(count, dtype) if rank == 0 else None
            ctx.reduce(every[rank], red, root=0)
            if rank == 0:
                check(f"reduce {dtype.__name__} {count}", red,
                      np.sum(np.stack(every), axis=0).astype(dtype))
            root = world - 1
            gathered = np.full(world * count, 9, dtype) if rank == root else None
            ctx.gather(every[rank], gathered, root=root)
            if rank == root:
                check(f"gather {dtype.__name__} {count}", gathered, np.concatenate(every))
            part = np.empty(count, dtype)
            ctx.scatter(np.concatenate(every) if rank == 0 else None, part, root=0)
            check(f"scatter {dtype.__name__} {count}", part, every[rank])
            mine = np.concatenate([contribution(rank, count, dtype, j) for j in range(world)])
            got = np.empty(world * count, dtype)
            ctx.alltoall(mine, got)
            check(f"alltoall {dtype.__name__} {count}", got,
                  np.concatenate([contribution(i, count, dtype, rank) for i in range(world)]))
    counts = [r + 1 for r in range(world)]
    v = np.empty(sum(counts), np.float32)
    ctx.allgatherv(np.full(rank + 1, rank, np.float32), v, counts)
    check("allgatherv", v, np.concatenate([np.full(r + 1, r, np.float32) for r in range(world)]))
    bf = np.array([0x3F80, 0x4000], np.uint16)  # bfloat16 1.0 and 2.0, in uint16 arrays
    ctx.allreduce(bf, dtype="bfloat16")
    want = {1: [0x3F80, 0x4000], 2: [0x4000, 0x4080], 3: [0x4040, 0x40C0], 4: [0x4080, 0x4100]}
    check("bfloat16", bf, np.array(want[world], np.uint16))
    # Uneven all-to-all: rank i sends i + j + 1 elements to rank j.
    send = np.concatenate([np.full(rank + j + 1, 10 * rank + j, np.int32) for j in range(world)])
    recv = np.empty(sum(i + rank + 1 for i in range(world)), np.int32)
    ctx.alltoall(send, recv, send_counts=[rank + j + 1 for j in range(world)],
                 recv_counts=[i + rank + 1 for i in range(world)])
    check("alltoallv", recv,
          np.concatenate([np.full(i + rank + 1, 10 * i + rank, np.int32) for i in range(world)]))
    if world > 1:  # a ring of async sends and receives
        right, left = (rank + 1) % world, (rank - 1) % world
        got = np.zeros(1000, np.float64)
        works = [ctx.send(np.full(1000, rank, np.float64), right, tag=3, async_op=True),
                 ctx.recv(got, left, tag=3, async_op=True)]
        for w in works:
            w.wait()
        check("send/recv ring", got, np.full(1000, left, np.float64))
    ctx.barrier()
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_collective_matches_numpy(world):
    for rank, failures in enumerate(ranks.run(world, grid, "numpy")):
        assert not failures, f"rank {rank}: " + "\n".join(failures)


def gil_released(rank, world, flag):
    # Rank 1 joins the all-reduce only once a thread of rank 0 has run Python code while
    # rank 0's main thread is inside the call: held GIL, no release, no join (a timeout).
    import gradsync
    ctx = gradsync.init(timeout=60)
    a = np.ones(10, np.float32)
    if rank == 0:
        threading.Timer(0.2, lambda: open(flag, "w").close()).start()
        ctx.allreduce(a)
    else:
        while not os.path.exists(flag):
            time.sleep(0.01)
        ctx.allreduce(a)
    return float(a[0])


def test_the_gil_is_released_while_a_call_waits(tmp_path):
    assert ranks.run(2, gil_released, "numpy", str(tmp_path / "go")) == [2.0, 2.0]


def errors(rank, world):
    import gradsync
    ctx = gradsync.init()
    found = {}
    read_only = np.ones(3, np.float32)
    read_only.setflags(write=False)
    for name, call in {
        "op": lambda: ctx.allreduce(np.ones(3, np.float32), op="median"),
        "strided": lambda: ctx.allreduce(np.ones((4, 4), np.float32)[:, 1]),
        "read-only": lambda: ctx.broadcast(read_only),
        "dtype": lambda: ctx.allreduce(np.ones(3, np.complex64)),
        "sizes": lambda: ctx.allgather(np.ones(3, np.float32), np.ones(5, np.float32)),
    }.items():
        try:
            call()
            found[name] = "no error"
        except gradsync.Error as e:
            found[name] = (e.kind, e.op, str(e))
    try:
        ctx.allreduce(np.ones(10 + rank, np.float32))
        found["mismatch"] = "no error"
    except gradsync.Error as e:
        found["mismatch"] = (e.kind, e.rank, e.peer, str(e), isinstance(e, RuntimeError))
    return found


def test_errors_are_gradsync_errors_with_the_cpp_fields():
    for rank, found in enumerate(ranks.run(2, errors, "numpy")):
        assert found["op"][:2] == ("invalid argument", "allreduce") and "median" in found["op"][2]
        assert f"rank {rank}" in found["op"][2]
        assert "contiguous" in found["strided"][2]
        assert "read-only" in found["read-only"][2]
        assert "complex64" in found["dtype"][2]
        assert "5" in found["sizes"][2] and "3" in found["sizes"][2]
        kind, err_rank, peer, message, is_runtime = found["mismatch"]
        # The rank that sees the other's message first names the mismatch; the other learns
        # of it as the group's abort, with the same story.
        assert kind in ("mismatched call", "aborted") and "mismatched call" in message, message
        assert (err_rank, peer, is_runtime) == (rank, 1 - rank, True), message
