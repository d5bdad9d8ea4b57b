"""Which forward values the backward keeps: a library over csrc/partition that cleans a joint
graph, proposes and decides cuts, extracts the forward and backward modules and describes the
decision (the planning layer, deepcompile_remat/planning, runs these steps)."""
from deepcompile_remat.partition.cut import PartitionConflictError
from deepcompile_remat.partition.report import (
    PartitionReport,
    SavedValue,
    clear_reports,
    reports,
)
