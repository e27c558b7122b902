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


def mismatched_shapes(rank, world):
    t = torch.ones(10 if rank == 0 else 20)
    try:
        dist.all_reduce(t)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_tensors_of_different_sizes_across_ranks_fail_naming_both():
    for message in ranks.run(2, mismatched_shapes, expect_failure=True).values():
        assert "10" in message and "20" in message and "mismatch" in message, message


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
