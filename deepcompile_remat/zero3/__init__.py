"""ZeRO-3 runtime for compiled graphs: sharded parameters re-expressed as traced gathers."""
from deepcompile_remat.zero3.clip import clip_grad_norm_
from deepcompile_remat.zero3.custom_ops import (CommStats, barrier_before_exit, collectives_in_flight,
                                                release_in_flight)
from deepcompile_remat.zero3.eager_unit import eager_unit
from deepcompile_remat.zero3.layers import compile_by_layer, repeated_layers
from deepcompile_remat.zero3.shard import ShardSpec, gathered_parameters, is_sharded, shard

__all__ = ["CommStats", "ShardSpec", "barrier_before_exit", "clip_grad_norm_",
           "collectives_in_flight", "compile_by_layer", "eager_unit", "gathered_parameters",
           "is_sharded", "release_in_flight", "repeated_layers", "shard"]
