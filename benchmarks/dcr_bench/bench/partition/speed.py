"""bench-partition's end-to-end speed: torch's whole partition call, ours "before" (the passes
ours replaced: FX's DCE, torch's fx_graph_cse and extraction) and ours, alternated over
repetitions, with our phases (SpeedRow)."""
from __future__ import annotations

import contextlib
import copy
import gc
import statistics
import time
from dataclasses import dataclass

from dcr_bench.bench.joint_capture import JointCapture


@dataclass
class SpeedRow:
    """One partitioner on one graph: medians over the repetitions, milliseconds. Phases are
    ours (zero for torch's row); `vs_torch` is torch's median over this row's."""
    graph: str
    partitioner: str  # "torch", "ours before" (torch's DCE, CSE, extraction) or "ours"
    nodes: int
    ms: float
    vs_torch: float
    prepare_ms: float
    export_ms: float
    solve_ms: float
    extract_ms: float  # place + order + build + the hooks' passes (none here)
    place_ms: float
    order_ms: float
    build_ms: float
    extract_path: str  # "ours", "torch" (before), or "torch: <why ours stepped aside>"
    spread_ms: tuple  # (min, max)


def as_compile_calls_it() -> contextlib.ExitStack:
    """The context AOTAutograd calls a partitioner in: a tracing context (without one, FX's
    dead-code elimination keeps unused random ops, SDPA included, alive) and lazy modules."""
    from torch._guards import TracingContext, tracing
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    stack = contextlib.ExitStack()
    stack.enter_context(tracing(TracingContext(None)))
    stack.enter_context(_use_lazy_graph_module(True))
    return stack


class ExtractTimes:
    """Wraps extract.extract_fwd_bwd_modules while entered so that each call fills `last`
    with the path it took and our extraction's phases (place, order, build seconds)."""

    def __init__(self):
        from deepcompile_remat.partition import extract

        self.last: dict = {}
        self._extract = extract
        self._real = extract.extract_fwd_bwd_modules

    def __call__(self, *args, **kwargs):
        """Our extraction, timed into `last`."""
        self.last = {}
        return self._real(*args, times=self.last, **kwargs)

    def __enter__(self):
        self._extract.extract_fwd_bwd_modules = self
        return self

    def __exit__(self, *exc):
        self._extract.extract_fwd_bwd_modules = self._real


def _fresh_joint(cap: JointCapture):
    """A deep copy of the captured joint graph for one timed call, with the cyclic collector
    run after it. The copy leaves the collector's counters wherever it ends; without the
    collection a full one (~0.4 s over these graphs) fell inside whichever call and phase
    crossed the threshold: llama16's export read 22 ms in one run, 448 in the next."""
    joint = copy.deepcopy(cap.joint)
    gc.collect()
    return joint


def time_torch(cap: JointCapture) -> float:
    """Seconds of one min_cut_rematerialization_partition call on a fresh copy."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    joint = _fresh_joint(cap)
    with as_compile_calls_it():
        t0 = time.perf_counter()
        min_cut_rematerialization_partition(
            joint, [], compiler="inductor", num_fwd_outputs=cap.num_fwd_outputs,
            static_lifetime_input_indices=cap.static_lifetime_input_indices)
        return time.perf_counter() - t0


def time_ours(cap: JointCapture, partition_fn) -> tuple[float, object, dict]:
    """Seconds of one call of our partition_fn on a fresh copy, its PartitionReport, and the
    extraction's path and phases."""
    from deepcompile_remat.partition import reports

    joint = _fresh_joint(cap)
    with as_compile_calls_it(), ExtractTimes() as times:
        t0 = time.perf_counter()
        partition_fn(joint, [], num_fwd_outputs=cap.num_fwd_outputs,
                     static_lifetime_input_indices=cap.static_lifetime_input_indices)
        seconds = time.perf_counter() - t0
    return seconds, reports()[-1], times.last or {"path": "torch"}


def measure_speed(name: str, cap: JointCapture, reps: int, policy: str) -> list[SpeedRow]:
    """torch, ours before and ours, alternated `reps` times after one untimed warm-up call
    each (imports, op tables, caches); one SpeedRow each."""
    from deepcompile_remat.config import RematConfig
    from deepcompile_remat.planning import remat_partition_fn

    # "before": the same cut with the passes ours replaced (torch's cleaning and extraction).
    ours_fn = {before: remat_partition_fn(RematConfig(policy=policy), torch_passes=before)
               for before in (True, False)}
    time_torch(cap), time_ours(cap, ours_fn[True]), time_ours(cap, ours_fn[False])
    torch_s, runs = [], {True: [], False: []}
    for _ in range(reps):
        torch_s.append(time_torch(cap))
        for before in (True, False):
            runs[before].append(time_ours(cap, ours_fn[before]))
    med, ms = statistics.median, 1e3
    nodes = sum(1 for n in cap.joint.graph.nodes if n.op != "output")
    spread = lambda xs: (round(min(xs) * ms, 1), round(max(xs) * ms, 1))  # noqa: E731
    rows = [SpeedRow(name, "torch", nodes, med(torch_s) * ms, 1.0, 0, 0, 0, 0, 0, 0, 0, "",
                     spread(torch_s))]
    for before in (True, False):
        secs = [r[0] for r in runs[before]]
        reps_ = [r[1] for r in runs[before]]
        phases = [r[2] for r in runs[before]]
        rows.append(SpeedRow(
            name, "ours before" if before else "ours", nodes, med(secs) * ms,
            med(torch_s) / med(secs),
            med(r.prepare_s for r in reps_) * ms, med(r.export_s for r in reps_) * ms,
            med(r.solve_s for r in reps_) * ms, med(r.extract_s for r in reps_) * ms,
            med(t.get("place_s", 0.0) for t in phases) * ms,
            med(t.get("order_s", 0.0) for t in phases) * ms,
            med(t.get("build_s", 0.0) for t in phases) * ms,
            phases[-1].get("path", "?"), spread(secs)))
    return rows
