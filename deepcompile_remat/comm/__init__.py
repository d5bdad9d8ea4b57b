"""Fused collectives for ZeRO-3: cast each shard into its slot, then gather in place.

    cast_and_gather(shards, outputs=None, dtype=None, group=None, async_op=False)
    cast_and_gather_packed(shards, dtype=None, group=None, async_op=False)
        -> one (world x total) buffer, or a GatherHandle
    cast_and_gather_mixed(shards, dtypes, group=None, async_op=False)
        -> the same for items of different dtypes: one uint8 buffer (unpack_mixed unpacks it)
    cuda_available()    -> True when the CUDA cast module was built and imports
    cuda_usable()       -> ... and matches this torch's CUDA and the driver (else torch casts)
    cuda_build_info()   -> what the build found, and why the CUDA module is missing if it is
"""
from deepcompile_remat.comm.cast_gather import (GatherHandle, cast_and_gather,
                                                  cast_and_gather_mixed, cast_and_gather_packed,
                                                  packed_byte_layout, unpack_mixed)
from deepcompile_remat.comm.cuda_module import cuda_available, cuda_build_info
from deepcompile_remat.comm.cuda_module import usable as cuda_usable
from deepcompile_remat.comm.nan_policy import torch_nan_option

__all__ = ["GatherHandle", "cast_and_gather", "cast_and_gather_mixed", "cast_and_gather_packed",
           "cuda_available", "cuda_build_info", "cuda_usable", "packed_byte_layout",
           "torch_nan_option", "unpack_mixed"]
