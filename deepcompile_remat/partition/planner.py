"""Peak-target mode: the fastest plan whose simulated peak fits (RematConfig.peak_target).

memory_budget bounds the bytes the forward saves. That is not the peak: what a cut recomputes
comes back in the backward, so the least-saving cut can peak higher than the ordinary one (at
llama 4x512 seq 1024, memory_budget 0 raised the step's peak from 138 to 179 MB). This mode
states the peak itself and plans each joint graph against it:

1. Candidates. Every vertex of two parametric min-cut hulls (partition/budget.py), EDGE_POINTS
   cuts inside each of their edges (the sweep's choice at even steps of the edge's saved
   bytes: where the gathers all cost the same per byte, keeping some of them lies inside one
   edge, not on a vertex), and the ordinary cut:
   - "re-gather": with the ZeRO-3 marking, every gathered weight is re-gathered in the
     backward; the hull trades saved activations against recomputation;
   - "keep-gathered": without the marking, a gathered weight may be kept from the forward (what
     DeepCompile's selective unsharding does with spare memory). Re-gathering it is priced at
     its gathered bytes (fx_arrays.RECOMPUTE_PRICE, set by the runtime), so the hull chooses
     per weight which to keep, the cheapest per byte first.
   Only graphs with parameter gathers have the second family.
2. Cost: the flops the backward recomputes (budget.recompute_cost_of, re-gathers at their
   price), summed over the nodes the cut leaves to the backward. The fastest plan is the one
   with the least cost.
3. Peak: each candidate is built as the partitioner builds it (extraction, then the hooks'
   passes: the ZeRO-3 schedule, buckets) and the memory simulator (csrc/memsim) runs the
   forward and the backward in their final order. Under inductor a pointwise op or cast whose
   one reader is a pointwise op, a cast or a reduction allocates nothing (fused_away). The
   step's peak is the larger of the two, both counting the parameters (shards) as resident
   and the batch, the backward its saved values and tangents; the forward's user outputs
   (logits) are taken as dropped before the backward, as a training loop that keeps only the
   loss drops them (held, they add their bytes to the backward's peak).
4. Choice: candidates in ascending cost; the first whose simulated peak fits the target wins.
   Then buckets: the chosen cut is built again with collective buckets BUCKET_STEP, then
   BUCKET_STEP^2, ... times the configured bucket_bytes, and the largest whose peak still fits
   is kept (fewer collectives for the same bytes: on gloo each costs ms whatever its size).
   Ties go to fewer saved bytes, then to the family order above, then to the node ids, so every
   rank decides the same on the same graph. A byte target no candidate fits raises
   PeakTargetInfeasibleError naming the smallest simulated peak; a fraction no candidate
   reaches takes the lowest-peak plan with a warning (PlanSummary.met False), as memory_budget
   raises a fraction to the smallest legal cut: with graph breaks, a small graph may have no
   plan below its ordinary cut.

The target is per compiled graph: with graph breaks, each graph is planned on its own, and the
saved values of earlier graphs in the step are not counted against a later one.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import numpy as np
import torch.fx as fx

from deepcompile_remat import _C, fx_arrays
from deepcompile_remat.config import PeakTargetInfeasibleError
from deepcompile_remat.partition import budget, fx_export
from deepcompile_remat.partition.op_classes import OpClass, classify

_PARAMETER = int(_C.NodeFlag.PARAMETER)
log = logging.getLogger(__name__)
FAMILIES = ("default", "re-gather", "keep-gathered")  # tie-break order (module docstring)
MAX_EVALUATED = 48  # builds per graph at most; beyond it the hulls are thinned evenly
EDGE_POINTS = 3  # cuts taken inside each hull edge, at even steps of its saved bytes
BUCKET_STEP = 4  # bucket sizes tried: the configured one times powers of this


@dataclass(frozen=True)
class Candidate:
    """One cut the planner may pick: its family, saved node ids and recompute cost."""
    family: str
    saved_ids: tuple[int, ...]
    recompute_cost: float
    saved_bytes: float
    node_info: np.ndarray  # the node_info of the solve it came from (aliases, regions)


@dataclass(frozen=True)
class PlanSummary:
    """Peak-target mode's decision for one graph (PartitionReport.plan). Peaks are the memory
    simulator's, in bytes, inputs (parameter shards, the batch) included."""
    target_bytes: float              # the target in bytes (not met: the lowest plan's peak)
    predicted_peak_bytes: float      # the chosen plan's step peak
    forward_peak_bytes: float
    backward_peak_bytes: float
    inputs_bytes: float              # resident throughout: the parameters (shards) it reads
    default_peak_bytes: float        # the ordinary cut's (what no target gets)
    min_peak_bytes: float            # the smallest of the plans evaluated (all: when none fit)
    family: str                      # FAMILIES
    recompute_cost: float            # flops (re-gathers at their price)
    default_recompute_cost: float
    saved_bytes: float
    kept_gathers: int                # gathered weights the forward hands the backward
    candidates: int                  # distinct cuts on the hulls
    evaluated: int                   # of them built and simulated
    met: bool = True                 # False: a fraction no plan reached; the lowest plan taken
    bucket_bytes: float = 0.0        # the collective bucket size the plan uses


def resolve_target(peak_target: float, default_peak_bytes: float) -> float:
    """Bytes (RematConfig.peak_target): a number <= 1 is a fraction of the ordinary cut's
    simulated peak, a number > 1 is bytes, taken as is."""
    if isinstance(peak_target, bool) or not isinstance(peak_target, (int, float)):
        raise TypeError(f"peak_target must be a number, got {type(peak_target).__name__}")
    if not math.isfinite(peak_target) or peak_target < 0:
        raise ValueError(f"peak_target must be >= 0 and finite, got {peak_target}")
    if peak_target <= 1:
        return float(peak_target) * default_peak_bytes
    return float(peak_target)


def candidates(graph: fx_export.ExportedJointGraph, *, policy: str,
               mark_parameter_aliases: bool) -> list[Candidate]:
    """The ordinary cut and the hull vertices of both families (module docstring), distinct
    saved sets, in the choice order: ascending cost, then fewer saved bytes, family, ids."""
    costs = budget.recompute_costs(graph)
    found: dict[tuple, Candidate] = {}

    def add(family, point: budget.BudgetPoint, node_info):
        key = tuple(int(i) for i in point.saved_ids)
        if key not in found:  # cost: every node the backward recomputes, at its own price
            found[key] = Candidate(family, key, float(costs[point.recomputed_ids].sum()),
                                   point.saved_bytes, node_info)

    families = [("re-gather", True), ("keep-gathered", False)] if mark_parameter_aliases else [
        ("keep-gathered", False)]
    sweeps = [(family, budget.BudgetSweep(graph, policy=policy, mark_parameter_aliases=mark,
                                          recompute_cost=costs)) for family, mark in families]
    cut = _C.partition_joint_graph(graph, policy=budget.POLICY[policy],
                                   mark_parameter_aliases=mark_parameter_aliases)
    # sweeps[0] has the ordinary cut's marking: it prices the ordinary cut's saved set.
    add("default", sweeps[0][1].evaluate(cut.saved_nodes), np.asarray(cut.node_info))
    has_gathers = bool(parameter_gathers(graph).any())
    for family, sweep in sweeps:
        if family == "keep-gathered" and mark_parameter_aliases and not has_gathers:
            continue  # without gathers both families are the same cuts
        try:
            hull = sweep.hull()
        except _C.PartitionConflictError:
            if family == "re-gather":
                raise  # the ordinary cut's constraints: they conflicted there already
            continue  # keeping gathered weights broke a region's constraints: not a plan
        info = np.asarray(sweep.node_info)
        for point in hull:
            add(family, point, info)
        for lo, hi in zip(hull, hull[1:]):  # inside each edge (module docstring, 1.)
            for k in range(1, EDGE_POINTS + 1):
                budget_bytes = lo.saved_bytes + k * (hi.saved_bytes - lo.saved_bytes) / (
                    EDGE_POINTS + 1)
                add(family, sweep.choose(math.floor(budget_bytes)).point, info)
    order = {f: i for i, f in enumerate(FAMILIES)}
    return sorted(found.values(), key=lambda c: (c.recompute_cost, c.saved_bytes,
                                                 order[c.family], c.saved_ids))


def parameter_gathers(graph: fx_export.ExportedJointGraph) -> np.ndarray:
    """bool[n]: node i gathers a parameter (a GATHER that reads a parameter primal)."""
    reads_parameter = np.zeros(len(graph.nodes), dtype=bool)
    tails, heads = np.asarray(graph.edge_tails), np.asarray(graph.edge_heads)
    reads_parameter[heads[(np.asarray(graph.flags)[tails] & _PARAMETER) != 0]] = True
    return reads_parameter & (np.asarray(graph.op_class) == int(OpClass.GATHER))


def _thinned(cands: list[Candidate], limit: int) -> list[Candidate]:
    """At most `limit` candidates, evenly spread over the cost order, ends kept."""
    if len(cands) <= limit:
        return cands
    picks = sorted({round(k * (len(cands) - 1) / (limit - 1)) for k in range(limit)})
    return [cands[k] for k in picks]


_FUSED = (OpClass.POINTWISE, OpClass.CAST)  # ops a fusing compiler inlines into their reader
_FUSING_READERS = (OpClass.POINTWISE, OpClass.CAST, OpClass.REDUCTION)


def fused_away(gm: fx.GraphModule) -> set:
    """The nodes a fusing compiler (inductor) never writes to memory: a pointwise op or cast
    that is no graph output and whose one reader is a pointwise op, a cast or a reduction,
    into whose kernel it is inlined. An approximation: inductor also fuses through views, and
    into several readers where they share a kernel; a value read by two kernels is written."""
    outputs = set(gm.graph.find_nodes(op="output")[0].all_input_nodes)
    kinds = {n: classify(n) for n in gm.graph.nodes}
    return {n for n in gm.graph.nodes
            if kinds[n] in _FUSED and n not in outputs and len(n.users) == 1
            and kinds[next(iter(n.users))] in _FUSING_READERS}


def graph_peak(gm: fx.GraphModule, persistent_names: Iterable[str],
               fuses_pointwise: bool = True) -> tuple[float, float]:
    """(simulated peak, bytes of its persistent inputs) of `gm` in its own order: the inputs
    named in persistent_names (the parameters) live before and after it, so a step's peak
    above its memory at rest is the first less the second. fuses_pointwise: its compiler
    fuses (fused_away nodes allocate nothing)."""
    arrays = fx_arrays.graph_arrays(gm)
    memory = fx_arrays.memory_graph(gm, persistent_names, graph=arrays,
                                    no_buffer=fused_away(gm) if fuses_pointwise else ())
    is_input = np.asarray(memory.is_input)
    order = np.flatnonzero(is_input == 0).astype(np.int64)
    resident = float(np.asarray(memory.bytes)[np.asarray(memory.persistent) != 0].sum())
    return float(_C.simulate_memory(memory, order=order).peak_bytes), resident


@dataclass(frozen=True)
class Evaluation:
    """A candidate built and simulated: the modules (and whatever the builder returns), and
    the step's simulated peaks."""
    candidate: Candidate
    built: tuple   # the builder's result; built[0], built[1] are the forward and backward
    peak_bytes: float
    forward_peak_bytes: float
    backward_peak_bytes: float
    inputs_bytes: float
    bucket_bytes: Optional[float] = None  # None: as configured


def evaluate(candidate: Candidate, build: Callable[..., tuple],
             parameter_names: set[str], fuses_pointwise: bool = True,
             bucket_bytes: Optional[float] = None) -> Evaluation:
    """Builds `candidate` (build(candidate, bucket_bytes) returns (fw, bw, ...) after every
    pass; bucket_bytes None: as configured) and simulates it."""
    built = build(candidate, bucket_bytes)
    fw, bw = built[0], built[1]
    fw_peak, fw_resident = graph_peak(fw, parameter_names, fuses_pointwise)
    bw_peak, bw_resident = graph_peak(bw, parameter_names, fuses_pointwise)
    # Both on the forward's footing: the parameters the backward does not read are resident too.
    bw_peak += fw_resident - bw_resident
    return Evaluation(candidate, built, max(fw_peak, bw_peak), fw_peak, bw_peak, fw_resident,
                      bucket_bytes)


def bucket_ladder(configured: float, gathered_bytes: float) -> list[float]:
    """Bucket sizes to try above the configured one: x4 steps from it until one bucket could
    hold every gathered weight of the graph (none when the configured size is 0: buckets
    off)."""
    sizes, size = [], configured * BUCKET_STEP
    while configured > 0 and size < BUCKET_STEP * gathered_bytes:
        sizes.append(size)
        size *= BUCKET_STEP
    return sizes


def plan(graph: fx_export.ExportedJointGraph, *, peak_target: float, policy: str,
         mark_parameter_aliases: bool, build: Callable[..., tuple],
         parameter_names: set[str], fuses_pointwise: bool = True,
         bucket_bytes: float = 0.0) -> tuple[Evaluation, PlanSummary]:
    """The cheapest candidate whose simulated peak fits `peak_target` (module docstring), and
    its summary, then the largest bucket size (bucket_ladder above the configured
    bucket_bytes) with which its peak still fits: fewer collectives for the same bytes.
    build(candidate, bucket_bytes=None) -> (fw, bw, ...): the partitioner's extraction and
    passes;
    fuses_pointwise: the graphs' compiler fuses pointwise ops (inductor; fused_away).
    Raises PeakTargetInfeasibleError where none fits."""
    cands = candidates(graph, policy=policy, mark_parameter_aliases=mark_parameter_aliases)
    default = next(c for c in cands if c.family == "default")
    pool = _thinned(cands, MAX_EVALUATED)
    if default not in pool:
        pool = sorted([*pool[:-1], default], key=cands.index)
    done: dict[tuple, Evaluation] = {}

    def run(c: Candidate) -> Evaluation:
        if c.saved_ids not in done:
            done[c.saved_ids] = evaluate(c, build, parameter_names, fuses_pointwise)
        return done[c.saved_ids]

    base = run(default)
    target = resolve_target(peak_target, base.peak_bytes)
    chosen = next((e for e in map(run, pool) if e.peak_bytes <= target), None)
    smallest = min(e.peak_bytes for e in done.values())
    met = chosen is not None
    if not met:
        why = (f"peak_target {peak_target:g} asks for a simulated peak of {target:,.0f} bytes "
               f"for this graph ({len(graph.nodes)} nodes), but the smallest any plan reaches "
               f"is {smallest:,.0f} bytes ({smallest / base.peak_bytes:.3f} of the ordinary "
               f"cut's {base.peak_bytes:,.0f}; {len(done)} of {len(cands)} plans simulated)")
        if peak_target > 1:  # bytes: a limit the caller set
            raise PeakTargetInfeasibleError(
                f"deepcompile_remat: {why}. Set peak_target to at least that, or shard or "
                f"checkpoint more.", smallest)
        # A fraction is relative to each graph's own ordinary cut (module docstring): a graph
        # that cannot go that low gets its lowest plan, as memory_budget raises a fraction to
        # the smallest legal cut. The report says so (PlanSummary.met).
        log.warning("deepcompile_remat: %s; using that plan.", why)
        chosen = min(done.values(), key=lambda e: (e.peak_bytes, cands.index(e.candidate)))
        target = chosen.peak_bytes
    c = chosen.candidate
    gathers = parameter_gathers(graph)
    gathered = float(np.asarray(graph.bytes)[gathers].sum())
    for size in bucket_ladder(bucket_bytes, gathered):
        bigger = evaluate(c, build, parameter_names, fuses_pointwise, size)
        if bigger.peak_bytes > target:
            break  # a larger bucket holds more at once: it will not fit either
        chosen = bigger
    kept = int(gathers[list(c.saved_ids)].sum())
    summary = PlanSummary(
        target_bytes=target, predicted_peak_bytes=chosen.peak_bytes,
        forward_peak_bytes=chosen.forward_peak_bytes,
        backward_peak_bytes=chosen.backward_peak_bytes, inputs_bytes=chosen.inputs_bytes,
        default_peak_bytes=base.peak_bytes, min_peak_bytes=smallest, family=c.family,
        recompute_cost=c.recompute_cost, default_recompute_cost=default.recompute_cost,
        saved_bytes=c.saved_bytes, kept_gathers=kept, candidates=len(cands),
        evaluated=len(done), met=met, bucket_bytes=(bucket_bytes if chosen.bucket_bytes is None
                                           else chosen.bucket_bytes))
    return chosen, summary
