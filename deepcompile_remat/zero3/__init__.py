"""ZeRO-3 runtime for compiled graphs: sharded parameters re-expressed as traced gathers."""
from deepcompile_remat.zero3.ops import CommStats
from deepcompile_remat.zero3.shard import ShardSpec, is_sharded, shard
