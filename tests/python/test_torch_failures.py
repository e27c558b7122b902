"""Failures under the torch backend: each raises a Python exception naming what went wrong,
on every rank, never a hang."""
import os
import signal
import time

import torch
import torch.distributed as dist

import ranks


def lose_a_rank(rank, world):
    t = torch.ones(1000)
    dist.all_reduce(t)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        for _ in range(100):
            dist.all_reduce(t)
    except RuntimeError as e:
        return (type(e).__name__, str(e), time.monotonic() - start)
    return ("no error", "", 0.0)


def test_a_killed_rank_makes_every_other_rank_raise_naming_it():
    outcomes = ranks.run(3, lose_a_rank, expect_failure=True, dies=(1,))
    for rank in (0, 2):
        kind, message, seconds = outcomes[rank]
        assert kind == "Error", outcomes[rank]  # gradsync.Error, a RuntimeError
        assert "peer 1" in message or "rank 1" in message, message
        print(f"rank {rank} raised after {seconds:.2f} s: {message}")


def mismatched_shapes(rank, world, shapes):
    t = torch.ones(shapes[rank])
    try:
        dist.all_reduce(t)
    except RuntimeError as e:
        return str(e)
    return "no error"


# Which rank sees the other's message first is a race (see below): every rank names both
# counts and its own shape, and the rank that saw the mismatch also the other's shape.
def test_tensors_of_different_sizes_across_ranks_fail_naming_both():
    shapes = {0: (10,), 1: (20,)}
    outcomes = ranks.run(2, mismatched_shapes, "gradsync", shapes, expect_failure=True)
    for rank, message in outcomes.items():
        assert "mismatch" in message and "count=10" in message and "count=20" in message, message
        assert f"this rank's tensors: float32 [{shapes[rank][0]}]" in message, message
    assert ("float32 [10], rank 1's: float32 [20]" in outcomes[0]
            or "float32 [20], rank 0's: float32 [10]" in outcomes[1]), outcomes


# The same count in another shape: gloo would add [2, 3] to [3, 2] silently. Which rank sees
# the other's message first is a race; that rank names both shapes, and a rank aborted by it
# names its own, under the first rank's message.
def test_tensors_of_the_same_size_in_different_shapes_fail_naming_both():
    def names_both(shapes):
        outcomes = ranks.run(len(shapes), mismatched_shapes, "gradsync", shapes,
                             expect_failure=True)
        assert all("mismatch" in m for m in outcomes.values()), outcomes
        for rank, message in outcomes.items():
            assert f"this rank's tensors: float32 {list(shapes[rank])}" in message, message
        return outcomes

    outcomes = names_both({0: (2, 3), 1: (3, 2)})
    assert ("float32 [2, 3], rank 1's: float32 [3, 2]" in outcomes[0]
            or "float32 [3, 2], rank 0's: float32 [2, 3]" in outcomes[1]), outcomes
    # One odd rank among three: the odd rank, or one that received its message, names both.
    outcomes = names_both({0: (4, 3), 1: (3, 4), 2: (4, 3)})
    assert any("float32 [4, 3], rank 1's: float32 [3, 4]" in m
               or "float32 [3, 4], rank 0's: float32 [4, 3]" in m
               or "float32 [3, 4], rank 2's: float32 [4, 3]" in m
               for m in outcomes.values()), outcomes


def bad_arguments(rank, world):
    import gradsync
    errors = {}
    cases = {
        "dtype": lambda: dist.all_reduce(torch.quantize_per_tensor(torch.ones(3), 0.1, 0,
                                                                   torch.quint8)),
        "sparse": lambda: dist.all_reduce(torch.ones(3).to_sparse()),
        "gather size": lambda: dist.all_gather([torch.zeros(2)] * world, torch.zeros(3)),
    }
    for name, call in cases.items():
        try:
            call()
            errors[name] = "no error"
        except gradsync.Error as e:
            errors[name] = f"{e.kind}: {e}"
        except Exception as e:  # noqa: BLE001  torch's own refusal, before the backend
            errors[name] = f"torch {type(e).__name__}: {e}"
    # The group is still usable: argument errors are raised before anything is sent.
    t = torch.ones(2)
    dist.all_reduce(t)
    errors["after"] = t.tolist()
    return errors


# A tensor on another device never reaches the backend on this machine: there is no CUDA, and
# torch's dispatcher refuses meta tensors itself. The backend's check names the device.
def test_unknown_dtypes_and_sizes_are_refused_at_the_call():
    for errors in ranks.run(2, bad_arguments):
        assert "no dtype" in errors["dtype"], errors
        assert "sparse" in errors["sparse"] or "torch" in errors["sparse"], errors
        assert "[2]" in errors["gather size"] and "[3]" in errors["gather size"], errors
        assert errors["after"] == [2.0, 2.0]
