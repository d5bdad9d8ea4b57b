"""ZeRO-3 runtime for compiled graphs: sharded parameters re-expressed as traced gathers."""
from deepcompile_remat.zero3.clip import clip_grad_norm_
from deepcompile_remat.zero3.custom_ops import (CommStats, barrier_before_exit, collectives_in_flight,
                                                release_in_flight)
from deepcompile_remat.zero3.eager_unit import eager_unit
from deepcompile_remat.zero3.shard import ShardSpec, gathered_parameters, is_sharded, shard

__all__ = ["CommStats", "ShardSpec", "clip_grad_norm_", "gathered_parameters",
           "barrier_before_exit", "collectives_in_flight", "eager_unit", "is_sharded", "release_in_flight", "shard"]
