"""Which forward values the backward keeps (FX bridge over csrc/partition)."""
from deepcompile_remat.partition.partitioner import (
    PartitionConflictError,
    build_partition_fn,
    partition_joint_graph,
)
from deepcompile_remat.partition.report import (
    PartitionReport,
    SavedValue,
    clear_reports,
    reports,
)
