"""Time a step spends blocked in communication, the same measure for every system.

Every torch.distributed collective a system issues from Python returns a Work, and the host
blocks in Work.wait() until it is done: a synchronous collective waits inside the
torch.distributed call, an asynchronous one where the system asks for its result (ours' waits,
FSDP2's copy-out, DeepSpeed's hooks). `blocked()` times those waits (the class method,
patched for the duration), so what a row reports is the host time the step could not compute.
On a GPU a wait makes the stream wait, not the host: there the figure is the host time of the
waits only (near 0), and the profiler's CUDA timeline is the one to read. A collective waited
on inside C++ (torch's functional collectives in a compiled graph) is not seen.
"""
from __future__ import annotations

import contextlib
import time


@contextlib.contextmanager
def blocked():
    """Yields a one-element list that accumulates the seconds spent in Work.wait() calls made
    in the block (nested waits, a coalesced group's inside its own, count once)."""
    from torch._C._distributed_c10d import Work

    total, depth = [0.0], [0]
    original = Work.wait

    def timed_wait(self, *args, **kwargs):
        depth[0] += 1
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                total[0] += time.perf_counter() - t0

    Work.wait = timed_wait
    try:
        yield total
    finally:
        Work.wait = original
