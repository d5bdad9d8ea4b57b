"""The planning layer: one place that owns the modes (the ordinary cut, memory_budget,
peak_target) and the search over the runtime's settings, above the cut (partition/) and the
ZeRO-3 runtime (zero3/)."""
from deepcompile_remat.planning.partition_fn import partition_joint_graph, remat_partition_fn

__all__ = ["partition_joint_graph", "remat_partition_fn"]
