"""Every torch.distributed collective over the gradsync backend, every dtype, world sizes
1-4, against references computed with torch from what each rank contributes."""
import functools

import pytest
import torch
import torch.distributed as dist

import ranks

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64, torch.uint8, torch.int8, torch.int16, torch.bool]
DTYPES = FLOATS + INTS
COUNTS = [0, 1, 7, 1000]


def _in_float64(reduce):
    # torch has no prod or min for float16 on CPU: reduce exactly in float64, then convert.
    return lambda xs: reduce(torch.stack(xs).double()).to(xs[0].dtype)


def _bitwise(op):
    return lambda xs: functools.reduce(op, xs)


OPS = {
    dist.ReduceOp.SUM: _in_float64(lambda x: x.sum(0)),
    dist.ReduceOp.PRODUCT: _in_float64(lambda x: x.prod(0)),
    dist.ReduceOp.MIN: _in_float64(lambda x: x.min(0).values),
    dist.ReduceOp.MAX: _in_float64(lambda x: x.max(0).values),
}
BITWISE = {
    dist.ReduceOp.BAND: _bitwise(torch.bitwise_and),
    dist.ReduceOp.BOR: _bitwise(torch.bitwise_or),
    dist.ReduceOp.BXOR: _bitwise(torch.bitwise_xor),
}


def contribution(rank, count, dtype, salt=0):
    """What `rank` contributes: small integers, so every sum and product is exact in every
    dtype (float16 and bfloat16 included) at up to 4 ranks."""
    x = (torch.arange(count, dtype=torch.int64) * 3 + rank * 5 + salt) % 7
    if dtype == torch.bool:
        return (x % 3 != 0) if salt != 99 else (x % 5 != 0)
    if dtype.is_floating_point:
        x = x - 3  # negative values too
    return (x % 2 + 1 if salt == 99 else x).to(dtype)


def equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def checker(failures):
    """check(what, got, want) appends a failure (with the first values) unless equal."""
    def check(what, got, want):
        if not equal(got, want):
            failures.append(f"{what}: got {got.flatten()[:8].tolist()} want "
                            f"{want.flatten()[:8].tolist()} ({got.dtype}/{want.dtype})")
    return check


def collectives_grid(rank, world):
    failures = []
    check = checker(failures)

    for dtype in DTYPES:
        for count in COUNTS:
            everyone = [contribution(r, count, dtype) for r in range(world)]
            ops = {**OPS, **({} if dtype.is_floating_point else BITWISE)}
            for op, reference in ops.items():
                salt = 99 if op == dist.ReduceOp.PRODUCT else 0
                inputs = [contribution(r, count, dtype, salt) for r in range(world)]
                t = inputs[rank].clone()
                dist.all_reduce(t, op=op)
                check(f"all_reduce {op} {dtype} {count}", t, reference(inputs))
                t = inputs[rank].clone()
                dist.reduce(t, dst=world - 1, op=op)
                if rank == world - 1:
                    check(f"reduce {op} {dtype} {count}", t, reference(inputs))
            t = everyone[rank].clone() if rank == 0 else torch.zeros(count, dtype=dtype)
            dist.broadcast(t, src=0)
            check(f"broadcast {dtype} {count}", t, everyone[0])
            outs = [torch.full((count,), 9, dtype=dtype) for _ in range(world)]
            dist.all_gather(outs, everyone[rank])
            check(f"all_gather {dtype} {count}", torch.stack(outs), torch.stack(everyone))
            flat = torch.empty(world * count, dtype=dtype)
            dist.all_gather_into_tensor(flat, everyone[rank])
            check(f"all_gather_into_tensor {dtype} {count}", flat, torch.cat(everyone))
            blocks = [contribution(rank, count, dtype, salt=b) for b in range(world)]
            out = torch.zeros(count, dtype=dtype)
            dist.reduce_scatter(out, blocks)
            want = OPS[dist.ReduceOp.SUM]([contribution(r, count, dtype, salt=rank)
                                           for r in range(world)])
            check(f"reduce_scatter {dtype} {count}", out, want)
            out = torch.zeros(count, dtype=dtype)
            dist.reduce_scatter_tensor(out, torch.cat(blocks))
            check(f"reduce_scatter_tensor {dtype} {count}", out, want)
    # AVG, which torch passes straight to the backend.
    t = torch.full((5,), float(rank))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    check("all_reduce AVG", t, torch.full((5,), (world - 1) / 2))
    # The coalesced forms.
    tensors = [contribution(rank, n, torch.float32) for n in (3, 0, 10)]
    dist.all_reduce_coalesced(tensors)
    for n, t in zip((3, 0, 10), tensors):
        check(f"all_reduce_coalesced {n}",
              t, sum(contribution(r, n, torch.float32) for r in range(world)))
    ins = [contribution(rank, n, torch.float32) for n in (2, 5)]
    outs = [[torch.zeros(n) for n in (2, 5)] for _ in range(world)]
    dist.all_gather_coalesced(outs, ins)
    for r in range(world):
        for i, n in enumerate((2, 5)):
            check(f"all_gather_coalesced {r} {n}", outs[r][i], contribution(r, n, torch.float32))
    dist.barrier()
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_collective_and_dtype_matches_torch(world):
    for rank, failures in enumerate(ranks.run(world, collectives_grid)):
        assert not failures, f"rank {rank}: " + "\n".join(failures)


def non_contiguous(rank, world):
    # Columns of a row-major matrix: every collective must write through the strides.
    m = torch.arange(24, dtype=torch.float32).view(4, 6) + rank
    col = m.t()[1:4]
    dist.all_reduce(col)
    want = (torch.arange(24, dtype=torch.float32).view(4, 6).t()[1:4]) * world + sum(range(world))
    b = (torch.zeros(6, 4) if rank else torch.ones(6, 4)).t()
    dist.broadcast(b, 0)
    outs = [torch.zeros(4, 6).t() for _ in range(world)]
    dist.all_gather(outs, (torch.ones(4, 6) * rank).t())
    return (equal(col, want), equal(b, torch.ones(4, 6)),
            all(equal(o, torch.full((6, 4), float(r))) for r, o in enumerate(outs)))


def test_non_contiguous_tensors_are_read_and_written_through_their_strides():
    for result in ranks.run(2, non_contiguous):
        assert result == (True, True, True)


def futures(rank, world):
    t = torch.ones(100) * (rank + 1)
    fut = dist.all_reduce(t, async_op=True).get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2)
    total = sum(range(1, world + 1))
    return (fut.wait()[0][0].item(), doubled.wait()[0].item(), total)


def test_futures_hold_a_list_of_tensors_and_chain():
    for value, doubled, total in ranks.run(3, futures):
        assert value == total and doubled == 2 * total


def init_methods(rank, world):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return (dist.get_backend(), t.item())


@pytest.mark.parametrize("init", ["tcp", "env", "file"])
def test_init_methods_meet_through_torchs_store(init, tmp_path):
    method = f"file://{tmp_path}/store" if init == "file" else init
    for backend, total in ranks.run(2, init_methods, init=method):
        assert backend == "gradsync" and total == 3.0


def subgroups(rank, world):
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    odds = dist.new_group([r for r in range(world) if r % 2 == 1])
    mine = evens if rank % 2 == 0 else odds
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    members = [r for r in range(world) if r % 2 == rank % 2]
    pair = dist.new_group([0, world - 1])
    u = torch.tensor([1.0])
    if rank in (0, world - 1):
        dist.all_reduce(u, group=pair)
    return (t.item() == sum(members), u.item() == (2.0 if rank in (0, world - 1) else 1.0))


def test_new_group_subgroups_reduce_among_their_members():
    for result in ranks.run(4, subgroups):
        assert result == (True, True)


def the_class(rank, world, port):
    from gradsync.torch import ProcessGroupGradsync
    import datetime
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    pg = ProcessGroupGradsync(store, rank, world, datetime.timedelta(seconds=60))
    t = torch.tensor([rank + 1.0])
    pg.allreduce([t]).wait()
    return (t.item(), pg.getBackendName() if hasattr(pg, "getBackendName") else "gradsync")


def test_the_process_group_class_is_built_as_gloos_is():
    port = ranks.free_port()
    for total, name in ranks.run(2, the_class, "gradsync-numpy", port):
        assert total == 3.0 and name == "gradsync"


def callback_waits(rank, world):
    import time
    t = torch.ones(10)
    if rank == 1:
        time.sleep(0.3)  # rank 0's future is still pending when it attaches the callback
    fut = dist.all_reduce(t, async_op=True).get_future()

    def then_another(f):
        # What torch's PowerSGD hook does: a collective waited for inside a callback.
        u = f.value()[0] * 2
        return dist.all_reduce(u, async_op=True).get_future().wait()[0]

    return fut.then(then_another).wait().tolist()


def test_a_callback_may_wait_for_a_later_call_of_its_group():
    for result in ranks.run(2, callback_waits):
        assert result == [8.0] * 10


def rooted_alltoall_p2p(rank, world):
    failures = []
    check = checker(failures)

    for dtype in DTYPES:
        for count in COUNTS:
            every = [contribution(r, count, dtype) for r in range(world)]
            root = world - 1
            outs = [torch.zeros(count, dtype=dtype) for _ in range(world)] if rank == root else None
            dist.gather(every[rank], outs, dst=root)
            if rank == root:
                check(f"gather {dtype} {count}", torch.stack(outs), torch.stack(every))
            out = torch.zeros(count, dtype=dtype)
            dist.scatter(out, [contribution(r, count, dtype, 5) for r in range(world)]
                         if rank == 0 else None, src=0)
            check(f"scatter {dtype} {count}", out, contribution(rank, count, dtype, 5))
            # all_to_all_single, equal blocks: block j of rank i is contribution(i, count, salt=j).
            send = torch.cat([contribution(rank, count, dtype, j) for j in range(world)])
            recv = torch.zeros(world * count, dtype=dtype)
            dist.all_to_all_single(recv, send)
            check(f"all_to_all_single {dtype} {count}", recv,
                  torch.cat([contribution(i, count, dtype, rank) for i in range(world)]))
    # Uneven splits: rank i sends i + j + 1 rows to rank j.
    send = torch.cat([torch.full((rank + j + 1, 2), float(10 * rank + j)) for j in range(world)])
    recv = torch.zeros(sum(i + rank + 1 for i in range(world)), 2)
    dist.all_to_all_single(recv, send, [i + rank + 1 for i in range(world)],
                           [rank + j + 1 for j in range(world)])
    check("all_to_all_single uneven", recv,
          torch.cat([torch.full((i + rank + 1, 2), float(10 * i + rank)) for i in range(world)]))
    ins = [torch.full((j + 1,), float(rank)) for j in range(world)]
    outs = [torch.zeros(rank + 1) for _ in range(world)]
    dist.all_to_all(outs, ins)
    for i, o in enumerate(outs):
        check(f"all_to_all from {i}", o, torch.full((rank + 1,), float(i)))
    # Point to point: a ring, isend and irecv, then batch_isend_irecv the other way.
    if world > 1:
        right, left = (rank + 1) % world, (rank - 1) % world
        got = torch.zeros(1000)
        reqs = [dist.isend(torch.full((1000,), float(rank)), right),
                dist.irecv(got, left)]
        for r in reqs:
            r.wait()
        check("ring isend/irecv", got, torch.full((1000,), float(left)))
        got = torch.zeros(3, dtype=torch.int64)
        ops = [dist.P2POp(dist.isend, torch.full((3,), rank, dtype=torch.int64), left),
               dist.P2POp(dist.irecv, got, right)]
        for r in dist.batch_isend_irecv(ops):
            r.wait()
        check("batch_isend_irecv", got, torch.full((3,), right, dtype=torch.int64))
        if rank == 0:
            dist.send(torch.arange(5.0), world - 1, tag=7)
        elif rank == world - 1:
            t = torch.zeros(5)
            dist.recv(t, 0, tag=7)
            check("send/recv", t, torch.arange(5.0))
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gather_scatter_all_to_all_and_point_to_point_match(world):
    for rank, failures in enumerate(ranks.run(world, rooted_alltoall_p2p)):
        assert not failures, f"rank {rank}: " + "\n".join(failures)


def empty_tensors(rank, world):
    e = lambda: torch.empty(0)  # noqa: E731
    t = e()
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    dist.reduce(t, 0)
    dist.all_gather([e() for _ in range(world)], t)
    dist.all_gather_into_tensor(e(), t)
    dist.reduce_scatter(t, [e() for _ in range(world)])
    dist.reduce_scatter_tensor(t, e())
    dist.gather(t, [e() for _ in range(world)] if rank == 0 else None, 0)
    dist.scatter(t, [e() for _ in range(world)] if rank == 0 else None, 0)
    dist.all_to_all_single(e(), e())
    if rank == 0:
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
    dist.all_reduce(torch.empty(0, 3))
    return "ok"


def empty_on_one_rank(rank, world):
    try:
        dist.all_reduce(torch.empty(0) if rank == 0 else torch.ones(4))
    except RuntimeError as e:
        return str(e)
    return "no error"


# Empty tensors move nothing, but every rank still takes part in the call: an empty tensor on
# one rank against a full one on another is a mismatch named at once, not a wait to the timeout.
def test_empty_tensors_are_no_ops_and_a_mismatch_when_only_one_rank_has_one():
    assert ranks.run(2, empty_tensors) == ["ok", "ok"]
    outcomes = ranks.run(2, empty_on_one_rank, expect_failure=True)
    assert "this rank's tensors: float32 [0]" in outcomes[0], outcomes
    assert "this rank's tensors: float32 [4]" in outcomes[1], outcomes
