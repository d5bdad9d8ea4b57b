"""Fixed glibc malloc thresholds, so a CPU step's time does not depend on the process's history.

torch's CPU allocator is glibc malloc. By default glibc serves a block above its mmap threshold
with a fresh mapping, and returns the top of its heap to the system once it passes a trim
threshold; both thresholds move with what was freed before (the "dynamic mmap threshold").
So one compiled step can pay a minor page fault per 4 KB of some of its buffers on every
step in one process and none in the next: measured on cut-quality's qwen2 fp32, ours' step
took 650-1,600 faults a step (+1-5% time) in three of six processes, torch's 100-600, and the
two timed within 0.5 ms in every process once the thresholds were fixed
(benchmarks/results/cut-quality/malloc-thresholds.txt). Neither partitioner's cut is at
fault: which step the thresholds happen to favour is history, and a GPU's caching allocator
has no such thing.

steady_cpu_malloc() fixes both (mallopt: setting a threshold also turns its adjustment off):
blocks up to 32 MiB (glibc's largest mmap threshold on 64-bit) come from the heap, and the
heap is kept. A no-op where the C library is not glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30


def steady_cpu_malloc() -> bool:
    """Fixes glibc's mmap and trim thresholds for this process (see the module docstring).
    Returns whether both were set."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
