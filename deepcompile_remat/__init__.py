"""deepcompile_remat: ZeRO-3-aware min-cut rematerialization for torch.compile.

Public surface (__all__, and what dir() lists): RematConfig; partition_fn / make_partition_fn
(AOTAutograd partitioners; a disabled config gives torch's own); backend(kind=None,
config=None) for torch.compile (kind defaults to config.backend_kind); compile(model,
config=None, kind=None), a model compiled as config.compile_scope says; reports() /
clear_reports() / PartitionReport; and the errors the product raises to users, all ValueError
subclasses: PartitionConflictError, BudgetInfeasibleError, PeakTargetInfeasibleError,
UnboundedCutError. The min-cut
solver is deepcompile_remat.mincut; the C++ core is deepcompile_remat._C.

`import deepcompile_remat` does not import torch: RematConfig and the errors come without it
(the errors are the C++ core's), and the torch-dependent names load on first use.
"""
from deepcompile_remat._C import (
    BudgetInfeasibleError,
    PartitionConflictError,
    UnboundedCutError,
    __version__,
)
from deepcompile_remat.config import PeakTargetInfeasibleError, RematConfig

# The C++ core defines these errors (csrc/python/error_types.h); their Python documentation
# is written here, once, whichever module re-exports them.
PartitionConflictError.__doc__ = (
    "Raised when the rematerialization constraints cannot all hold (a value that must be "
    "recomputed depends on one that may not be): the message names the chain of FX nodes and "
    "why each link can be neither saved nor recomputed. A subclass of ValueError.")
BudgetInfeasibleError.__doc__ = (
    "Raised when a byte budget (RematConfig.memory_budget > 1) is below the fewest bytes any "
    "legal cut saves; `.min_bytes` holds that smallest feasible budget, which the message "
    "names too. A fraction (<= 1) never raises: it is raised to that minimum. A subclass of "
    "ValueError.")
UnboundedCutError.__doc__ = (
    "Raised when the source reaches the sink through infinite-capacity arcs only; "
    "`.path` holds one such path of node ids. A subclass of ValueError.")

def __getattr__(name):
    # The torch-dependent names load on first access.
    if name in ("reports", "clear_reports", "PartitionReport"):
        from deepcompile_remat import partition

        return getattr(partition, name)
    if name in ("backend", "compile", "partition_fn", "make_partition_fn"):
        from deepcompile_remat import backends

        return getattr(backends, name)
    raise AttributeError(f"module 'deepcompile_remat' has no attribute {name!r}")


def __dir__():
    # The public names, whether or not they are loaded yet.
    return sorted(__all__)


__all__ = ["__version__", "RematConfig", "partition_fn", "make_partition_fn", "backend", "compile",
           "reports", "clear_reports", "PartitionReport", "PartitionConflictError",
           "BudgetInfeasibleError", "PeakTargetInfeasibleError", "UnboundedCutError"]
