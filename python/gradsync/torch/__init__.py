"""gradsync as a torch.distributed backend.

    import gradsync.torch                       # registers the backend "gradsync"
    torch.distributed.init_process_group("gradsync")

Everything else stays as it is: DistributedDataParallel, ZeroRedundancyOptimizer, comm hooks
and every torch.distributed collective on CPU tensors run over gradsync. The process-group
class is also gradsync.torch.ProcessGroupGradsync(store, rank, world_size, timeout), as
torch's ProcessGroupGloo is.
"""
import torch
import torch.distributed as dist

from .. import _build_info


def _check_torch_version():
    # A C++ extension built against one torch cannot be loaded into another: the process-group
    # ABI changes between releases, and the failure would otherwise be an undefined symbol.
    built = _build_info.torch_version
    if built and torch.__version__ != built:
        raise ImportError(
            f"gradsync.torch was built against torch {built}, but this interpreter has torch "
            f"{torch.__version__} ({torch.__file__}); rebuild gradsync with this torch")


_check_torch_version()

from ._backend import ProcessGroupGradsync, _create_process_group  # noqa: E402
from . import hooks  # noqa: E402,F401
from .observe import stats, write_timeline  # noqa: E402
from .workload import save_workload, workload  # noqa: E402

if not hasattr(dist.Backend, "GRADSYNC"):
    dist.Backend.register_backend("gradsync", _create_process_group)

__all__ = ["ProcessGroupGradsync", "hooks", "save_workload", "stats", "workload",
           "write_timeline"]
