"""The one memory meter of the harness: memory over a step, from the allocator's own accounting.

Every command measures with it (profile, compare, bench-deepspeed): the allocator's running
total, which counts tensors (what the product changes), not Python objects or a library's
own malloc'd buffers.

CPU: torch.profiler's allocation events (``profile_memory=True``) carry the CPU allocator's
running total after each allocation and free. That total is only exact if every thread counts:
c10 counts an allocation or a free only in threads where profiling is on, and gloo's worker
threads (where a collective's work object, with the tensors it holds, is often released) are
not among them, so each such free would leave its bytes in the total for good: +-10 MB of
noise between two ranks running the same graphs, at 4 MB per tensor. ``exact_cpu_counter()``
sets c10's ``FLAGS_caffe2_report_cpu_memory_usage`` (through ctypes: it has no Python API),
which makes the allocator count in every thread; the events still come from the profiled
threads, but the total they carry is then exact. Where the flag cannot be set (another build),
the measurement says so.

CUDA: the caching allocator's statistics (``memory_allocated``, ``max_memory_allocated``) are
exact; the profiler's CUDA allocation events draw the timeline.

A step is bracketed by ``record_function`` marks (FORWARD, BACKWARD, RELEASE); the forward peak
is the largest total up to the end of FORWARD, the backward peak the largest after it. All
figures are relative to the total at the step's start (model state and inputs already there).
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import sys
from dataclasses import dataclass

import numpy as np

FORWARD = "dcr.profile.forward"
BACKWARD = "dcr.profile.backward"
RELEASE = "dcr.profile.release"
MARKS = (FORWARD, BACKWARD, RELEASE)
_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"


def exact_cpu_counter() -> bool:
    """Makes the CPU allocator count allocations and frees of every thread (see the module
    docstring). Returns whether the flag could be set. Turn it on before the tensors to be
    measured are allocated (frees of tensors it never saw are not counted)."""
    import torch

    libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so*"))
    for path in libs:
        try:
            flag = ctypes.c_bool.in_dll(ctypes.CDLL(path), _FLAG)
        except (OSError, ValueError):
            continue
        flag.value = True
        return True
    return False


@contextlib.contextmanager
def _stderr_silenced():
    """File descriptor 2 to /dev/null for the duration (C++ writes there directly)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def op_table(prof, device_type: str, title: str, row_limit: int = 30) -> str:
    """Where a profiled step's time goes, per op: by device time (on a GPU) and by host time.
    A step whose host time far exceeds its device time is bound by launches and Python."""
    keys = (["self_device_time_total"] if device_type == "cuda" else []) + ["self_cpu_time_total"]
    averages = prof.key_averages()
    return "".join(f"== {title}, sorted by {key}\n"
                   + averages.table(sort_by=key, row_limit=row_limit, max_name_column_width=60)
                   + "\n" for key in keys)


@contextlib.contextmanager
def profiled(**kwargs):
    """torch.profiler.profile(**kwargs), without kineto's two lines per run on stderr
    ("USDT: ... profiler_start" / "profiler_stop", written by C++ whatever the log level): only
    starting and stopping the profiler run with stderr silenced."""
    from torch.profiler import profile

    prof = profile(**kwargs)
    with _stderr_silenced():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _stderr_silenced():
            prof.__exit__(None, None, None)


@dataclass
class StepMemory:
    """One training step's memory, from the profiler's allocator events: the peaks (whole step,
    forward, backward) and the forward/backward boundary, all relative to the step's start,
    plus the timeline they were read from."""
    start_bytes: float        # allocator total when the step began (model state, inputs)
    peak_bytes: float         # largest total over the step, minus start_bytes
    fw_peak_bytes: float      # ... up to the end of the forward (loss included)
    bw_peak_bytes: float      # ... from the backward's start to the step's end
    boundary_bytes: float     # alive when the forward ends: what it keeps for the backward
    t_ms: np.ndarray          # timeline: time since the step began
    live_bytes: np.ndarray    # ... and total minus start_bytes after each event
    fw_end_ms: float          # when the forward ended (t_ms's clock)
    bw_end_ms: float          # when the step ended (gradients released)
    release_ms: float = float("nan")  # when the backward ended and the release began


def step_marks(tree, names=MARKS) -> dict:
    """name -> (start ns, end ns) of the first record_function region of each name in an
    event_tree(prof)."""
    out = {}
    for n in tree.sorted_nodes:
        if n.name in names and n.name not in out:
            out[n.name] = (n.start_time_ns, n.end_time_ns)
    return out


def event_tree(prof):
    """The profiler's event tree of a finished profile (what the other readers here walk)."""
    from torch.profiler._memory_profiler import OpTree  # private: the profiler's event tree

    return OpTree(prof.profiler.kineto_results)


def allocation_nodes(tree, device_type: str) -> list:
    """The allocator's event nodes on `device_type` in time order; n.typed[1] holds the
    event (ptr, alloc_size (< 0: freed), total_allocated after it), n.parent the op that made
    it."""
    from torch._C._profiler import _EventType

    return sorted((n for n in tree.sorted_nodes
                   if n.typed[0] == _EventType.Allocation
                   and n.typed[1].device.type == device_type), key=lambda n: n.start_time_ns)


def _op_stack(node, depth: int) -> str:
    names, q = [], node.parent
    while q is not None and len(names) < depth:
        names.append(q.name[:50])
        q = q.parent
    return " < ".join(names)


def live_at_peak(prof, device_type: str, title: str, depth: int = 3, rows: int = 12) -> str:
    """What is alive at the highest point of a profiled region, as text: the peak above the
    region's start, the op stack at the peak, the live bytes per allocating op stack (`depth`
    ops up), and the largest blocks. A block allocated before the region is not seen."""
    from collections import defaultdict

    events = allocation_nodes(event_tree(prof), device_type)
    if not events:
        return f"{title}: no allocator events on {device_type}\n"
    start = events[0].typed[1].total_allocated - events[0].typed[1].alloc_size
    live, peak, at_peak, where = {}, -1.0, {}, None
    for n in events:
        a = n.typed[1]
        if a.alloc_size > 0:
            live[a.ptr] = (a.alloc_size, n)
        else:
            live.pop(a.ptr, None)
        if a.total_allocated - start > peak:
            peak, at_peak, where = a.total_allocated - start, dict(live), n
    lines = [f"{title}: peak {peak / 1e6:.3f} MB above the start "
             f"({sum(s for s, _ in at_peak.values()) / 1e6:.3f} MB allocated in the region)",
             "at: " + _op_stack(where, depth + 2)]
    blocks = [(size, _op_stack(n, depth)) for size, n in at_peak.values()]
    by_stack, count = defaultdict(float), defaultdict(int)
    for size, stack in blocks:
        by_stack[stack] += size
        count[stack] += 1
    for stack, size in sorted(by_stack.items(), key=lambda kv: -kv[1])[:rows]:
        lines.append(f"{size / 1e6:8.3f} MB {count[stack]:4d} blocks  {stack}")
    lines.append("largest blocks:")
    for size, stack in sorted(blocks, key=lambda b: -b[0])[:rows]:
        lines.append(f"{size / 1e3:9.1f} KB  {stack}")
    return "\n".join(lines) + "\n"


def allocation_events(tree, device_type: str) -> list:
    """(time ns, allocator total after it, bytes allocated (< 0: freed)) per allocator event
    on `device_type`, in time order."""
    return [(n.start_time_ns, n.typed[1].total_allocated, n.typed[1].alloc_size)
            for n in allocation_nodes(tree, device_type)]


def peak_over_profile(prof, device_type: str = "cpu") -> float:
    """Peak live bytes over a whole profiled region (no marks needed): the largest allocator
    total after an event, minus the total before the first event."""
    events = allocation_events(event_tree(prof), device_type)
    if not events:
        return 0.0
    return float(max(e[1] for e in events) - (events[0][1] - events[0][2]))


def from_profile(prof, device_type: str = "cpu") -> StepMemory:
    """The step's memory from a torch.profiler run of exactly one step (with the marks)."""
    tree = event_tree(prof)
    marks = step_marks(tree)
    missing = [m for m in MARKS if m not in marks]
    if missing:
        raise RuntimeError(f"profiled step lacks the marks {missing}")
    t0 = marks[FORWARD][0]
    fw_end, bw_end = marks[FORWARD][1], marks[RELEASE][1]
    events = [e for e in allocation_events(tree, device_type) if t0 <= e[0] <= bw_end]
    if not events:
        return StepMemory(0.0, 0.0, 0.0, 0.0, 0.0, np.zeros(1), np.zeros(1), 0.0, 0.0)
    start = float(events[0][1] - events[0][2])
    t = np.asarray([(e[0] - t0) / 1e6 for e in events])
    live = np.asarray([float(e[1]) for e in events]) - start
    fw = t <= (fw_end - t0) / 1e6
    return StepMemory(
        start_bytes=start, peak_bytes=float(max(live.max(), 0.0)),
        fw_peak_bytes=float(max(live[fw].max(), 0.0)) if fw.any() else 0.0,
        bw_peak_bytes=float(max(live[~fw].max(), 0.0)) if (~fw).any() else 0.0,
        boundary_bytes=float(live[fw][-1]) if fw.any() else 0.0,
        t_ms=np.concatenate([[0.0], t]), live_bytes=np.concatenate([[0.0], live]),
        fw_end_ms=(fw_end - t0) / 1e6, bw_end_ms=(bw_end - t0) / 1e6,
        release_ms=(marks[RELEASE][0] - t0) / 1e6)


def downsample(t: np.ndarray, y: np.ndarray, points: int = 1500) -> tuple[list, list]:
    """At most ~2*points samples that keep every bucket's minimum and maximum (peaks stay)."""
    if len(t) <= 2 * points:
        return t.tolist(), y.tolist()
    keep = {0, len(t) - 1}
    for chunk in np.array_split(np.arange(len(t)), points):
        keep.add(int(chunk[np.argmax(y[chunk])]))
        keep.add(int(chunk[np.argmin(y[chunk])]))
    idx = np.asarray(sorted(keep))
    return t[idx].tolist(), y[idx].tolist()


class CudaStepPeaks:
    """Exact forward/backward peaks from the CUDA caching allocator's statistics."""

    def __init__(self, device) -> None:
        self.device = device
        self.start = self.fw = self.bw = self.boundary = 0.0

    def begin(self) -> None:
        """Marks the step's start: synchronizes, resets the peak counter and records the allocated
        total as the baseline."""
        import torch

        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.start = float(torch.cuda.memory_allocated(self.device))

    def forward_done(self) -> None:
        """Marks the forward's end: records its peak and what stays alive for the backward, then
        resets the peak counter for the backward."""
        import torch

        self.fw = float(torch.cuda.max_memory_allocated(self.device)) - self.start
        self.boundary = float(torch.cuda.memory_allocated(self.device)) - self.start
        torch.cuda.reset_peak_memory_stats(self.device)

    def step_done(self) -> None:
        """Marks the step's end: synchronizes and records the backward's peak."""
        import torch

        torch.cuda.synchronize(self.device)
        self.bw = float(torch.cuda.max_memory_allocated(self.device)) - self.start

    def apply(self, mem: StepMemory) -> StepMemory:
        """The allocator's exact figures over the profiler's timeline."""
        mem.start_bytes = self.start
        mem.fw_peak_bytes, mem.bw_peak_bytes = max(self.fw, 0.0), max(self.bw, 0.0)
        mem.peak_bytes = max(mem.fw_peak_bytes, mem.bw_peak_bytes)
        mem.boundary_bytes = self.boundary
        return mem
