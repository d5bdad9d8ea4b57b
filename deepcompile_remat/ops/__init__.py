"""Fused collectives for ZeRO-3: cast each shard into its slot, then gather in place.

    allgather_cast(shards, outputs=None, dtype=None, group=None, async_op=False)
    cuda_available()    -> True when the CUDA + NCCL module was built
    cuda_build_info()   -> what the build found, and why the CUDA module is missing if it is
    destroy_communicators()  -> ncclCommDestroy the cached communicators (also at exit)
"""
from deepcompile_remat.ops.allgather_cast import AllGatherHandle, allgather_cast
from deepcompile_remat.ops.cuda_module import (cuda_available, cuda_build_info,
                                               destroy_communicators)
from deepcompile_remat.ops.nan_policy import torch_nan_option

__all__ = ["AllGatherHandle", "allgather_cast", "cuda_available", "cuda_build_info",
           "destroy_communicators", "torch_nan_option"]
