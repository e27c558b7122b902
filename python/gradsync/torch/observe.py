"""What gradsync did for a PyTorch job: per-step communication (gradsync.torch.stats()) and
one timeline with torch's steps and gradsync's calls (GRADSYNC_TIMELINE=FILE, written by
gradsync.torch.write_timeline()).

A step runs from one forward of a DistributedDataParallel module to the next: a forward
pre-hook marks each, so training code needs no change. With the timeline on, the step's
forward and backward are recorded too (category "compute"), backward from the gradient of
the module's output to the end of the autograd pass, before DDP's wait for its all-reduces:
gradsync-advise --trace reads from them what communication backward did not hide.
"""
import torch
import torch.distributed as dist
from torch.nn.modules.module import (register_module_forward_hook,
                                     register_module_forward_pre_hook)
from torch.nn.parallel import DistributedDataParallel

from .. import _gradsync
from ._backend import ProcessGroupGradsync

_marks = []      # now_us() at each DDP forward
_records = []    # (op, bytes, issued, started, done, sent_bytes) not yet given out by stats()
_MAX_MARKS = 1 << 16


def _mark_step(module, _inputs):
    if type(module) is not DistributedDataParallel:
        return
    now = _gradsync.now_us()
    if _marks and _gradsync.timeline_enabled():
        _gradsync.timeline_record(f"step {len(_marks)}", "step", _marks[-1], now)
    _marks.append(now)
    if len(_marks) > _MAX_MARKS:
        del _marks[: _MAX_MARKS // 2]


def _first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    items = output.values() if isinstance(output, dict) else output
    if isinstance(items, (list, tuple)) or isinstance(output, dict):
        for item in items:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _mark_forward(module, _inputs, output):
    if type(module) is not DistributedDataParallel or not _marks:
        return
    if not _gradsync.timeline_enabled():
        return
    step = len(_marks)
    _gradsync.timeline_record(f"forward {step}", "compute", _marks[-1], _gradsync.now_us())
    tensor = _first_tensor(output)
    if tensor is None:
        return

    def backward_started(grad):
        start = _gradsync.now_us()

        def backward_done():
            _gradsync.timeline_record(f"backward {step}", "compute", start, _gradsync.now_us())

        # Runs when the autograd pass ends, before DDP's own callback waits for its buckets.
        torch.autograd.Variable._execution_engine.queue_callback(backward_done)
        return grad

    tensor.register_hook(backward_started)


_hook = register_module_forward_pre_hook(_mark_step)
_forward_hook = register_module_forward_hook(_mark_forward)


def _group(group):
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupGradsync):
        raise TypeError(f"not a gradsync process group: {type(pg).__name__}")
    return pg


def stats(group=None):
    """Per finished step since the last call: a list of dicts with
    step (its number), step_s (its wall time), comm_s (time gradsync's worker spent on its
    calls), exposed_s (communication still running after the step's last call was issued:
    for DDP, what backward did not hide), calls, and bytes (wire bytes this rank sent).
    Calls belong to the step in which they were issued."""
    _records.extend(_group(group)._take_records())
    steps = []
    last_sent = None
    for k in range(len(_marks) - 1):
        begin, end = _marks[k], _marks[k + 1]
        mine = [r for r in _records if begin <= r[2] < end]
        if not mine:
            continue
        comm = sum(r[4] - r[3] for r in mine) / 1e6
        last_issue = max(r[2] for r in mine)
        exposed = max(0, max(r[4] for r in mine) - last_issue) / 1e6
        sent = max(r[5] for r in mine)
        before = [r[5] for r in _records if r[4] <= begin]
        base = last_sent if last_sent is not None else (max(before) if before else 0)
        steps.append(dict(step=k + 1, step_s=(end - begin) / 1e6, comm_s=comm, exposed_s=exposed,
                          calls=len(mine), bytes=sent - base))
        last_sent = sent
    # Keep what belongs to the step still running.
    if _marks:
        _records[:] = [r for r in _records if r[2] >= _marks[-1]]
        del _marks[:-1]
    return steps


def write_timeline(group=None, path=""):
    """Collective over the group: rank 0 writes every rank's timeline to `path` (default:
    GRADSYNC_TIMELINE). Returns the number of events written (0 on other ranks)."""
    return _group(group)._write_timeline(path)
