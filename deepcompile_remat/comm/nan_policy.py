"""Which NaN bits torch's own fp32 -> bf16/fp16 cast writes, probed once per (device, dtype).

Finite values and inf have one right answer (round to nearest even) and the kernels give it.
NaN does not: torch's CPU scalar path (c10) writes 0x7FC0 for every bf16 NaN, its AVX2/AVX512
vector path 0xFFFF, its CUDA path 0x7FFF; x86 F16C keeps the fp16 NaN payload. To stay
bit-identical to ``tensor.to(dtype)`` in *this* process, cast a probe of NaN patterns with torch
and pick the kernel NaN option that reproduces it. None means no option does (then callers use
torch's own cast, which is still correct, just not fused).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import numpy as np
import torch

# Signalling, quiet, negative, payload-carrying NaNs; repeated so torch's vector path runs too.
_PROBE_BITS = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0xFFC00000, 0x7FFFFFFF,
                        0x7FA00000, 0xFFFFFFFF, 0xFF812345, 0x7FD5A5A5, 0x7F80E000] * 7,
                       dtype=np.uint32)

_TARGETS = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


class NanOption(NamedTuple):
    """The cast kernels' NaN arguments (nan_mode, canonical_nan) that reproduce one torch cast."""
    nan_mode: str        # "quiet" or "canonical"
    canonical_nan: int   # used by "canonical"


def target_name(dtype: torch.dtype) -> str:
    """'bfloat16' / 'float16' for the kernels' dtype argument."""
    if dtype not in _TARGETS:
        raise ValueError(f"cast kernels write bfloat16 or float16, not {dtype}")
    return _TARGETS[dtype]


def _kernel_bits(option: NanOption, dtype: torch.dtype) -> np.ndarray:
    from deepcompile_remat import _C

    out = np.empty(_PROBE_BITS.size, dtype=np.uint16)
    _C.cast_fp32_into(_PROBE_BITS.view(np.float32), out, 0, target_name(dtype),
                      option.nan_mode, option.canonical_nan)
    return out


@functools.lru_cache(maxsize=None)
def torch_nan_option(device_type: str, dtype: torch.dtype) -> Optional[NanOption]:
    """The kernel NaN option matching torch's cast on `device_type` ('cpu'/'cuda'), or None."""
    src = torch.from_numpy(_PROBE_BITS.view(np.float32).copy()).to(device_type)
    want = src.to(dtype).view(torch.int16).cpu().numpy().view(np.uint16)
    candidates = [NanOption("canonical", int(want[0])), NanOption("quiet", 0)]
    for option in candidates:
        try:
            got = _kernel_bits(option, dtype)
        except ValueError:  # want[0] was not a NaN pattern: torch did something else
            continue
        if np.array_equal(got, want):
            return option
    return None
