"""deepcompile_remat: ZeRO-3-aware min-cut rematerialization for torch.compile.

Public surface: RematConfig, partition_fn / make_partition_fn (AOTAutograd partitioners; a
disabled config gives torch's own), backend(kind=None, config=None) for torch.compile (kind
defaults to config.backend_kind), reports() / clear_reports(), and the min-cut solver in
deepcompile_remat.mincut. The C++ core is deepcompile_remat._C.
"""
from deepcompile_remat._C import __version__
from deepcompile_remat.config import RematConfig


def __getattr__(name):
    # torch-dependent parts load lazily, so the solver works without importing torch.
    if name in ("reports", "clear_reports", "PartitionReport", "PartitionConflictError"):
        from deepcompile_remat import partition

        return getattr(partition, name)
    if name in ("backend", "partition_fn", "make_partition_fn"):
        from deepcompile_remat import backends

        return getattr(backends, name)
    raise AttributeError(f"module 'deepcompile_remat' has no attribute {name!r}")


__all__ = ["__version__", "RematConfig", "partition_fn", "make_partition_fn", "backend",
           "reports", "clear_reports", "PartitionReport", "PartitionConflictError"]
