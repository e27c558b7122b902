"""gradsync: fast collective communication for data-parallel training.

    import gradsync, numpy as np
    ctx = gradsync.init()            # RANK, WORLD_SIZE, MASTER_ADDR, ... as the C++ init() reads them
    grad = np.ones(1000, np.float32)
    ctx.allreduce(grad, op="avg")    # in place, zero-copy; async_op=True returns a Work

Every failure raises gradsync.Error (a RuntimeError) whose attributes kind, rank, peer, op,
bytes and detail are the C++ error's. PyTorch users: `import gradsync.torch`, then
`torch.distributed.init_process_group("gradsync")`.
"""
from ._gradsync import Context, Error, Work, __version__, init, timeline_write

__all__ = ["Context", "Error", "Work", "__version__", "init", "timeline_write"]
