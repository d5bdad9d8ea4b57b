"""Which forward values the backward keeps (FX bridge over csrc/partition)."""
from deepcompile_remat.partition.partitioner import (
    PartitionConflictError,
    partition_joint_graph,
    remat_partition_fn,
)
from deepcompile_remat.partition.report import (
    PartitionReport,
    SavedValue,
    clear_reports,
    reports,
)
