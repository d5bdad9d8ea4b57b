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
   forward and the backward in their final order: the step's peak is the larger of the
   forward's and the backward's, the backward's counting the forward's user outputs (the loss,
   the logits), which the caller holds through it. Both count the graph's inputs (parameter
   shards, the batch).
4. Choice: candidates in ascending cost; the first whose simulated peak fits the target wins.
   Ties go to fewer saved bytes, then to the family order above, then to the node ids, so every
   rank decides the same on the same graph. A target no candidate fits raises
   PeakTargetInfeasibleError naming the smallest simulated peak.

The target is per compiled graph: with graph breaks, each graph is planned on its own, and the
saved values of earlier graphs in the step are not counted against a later one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from deepcompile_remat import _C, fx_arrays
from deepcompile_remat.config import PeakTargetInfeasibleError
from deepcompile_remat.fx_values import value_bytes
from deepcompile_remat.partition import budget, fx_export
from deepcompile_remat.partition.op_classes import OpClass

_REQUIRED_FORWARD = int(_C.NodeInfoBit.REQUIRED_FORWARD)
_TANGENT_CLOSURE = int(_C.NodeInfoBit.TANGENT_CLOSURE)
_PRIMAL = int(_C.NodeFlag.PRIMAL)
_PARAMETER = int(_C.NodeFlag.PARAMETER)
FAMILIES = ("default", "re-gather", "keep-gathered")  # tie-break order (module docstring)
MAX_EVALUATED = 48  # builds per graph at most; beyond it the hulls are thinned evenly
EDGE_POINTS = 3  # cuts taken inside each hull edge, at even steps of its saved bytes


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
    target_bytes: float
    predicted_peak_bytes: float      # the chosen plan's step peak
    forward_peak_bytes: float
    backward_peak_bytes: float
    inputs_bytes: float              # alive before the forward: the graph's inputs
    default_peak_bytes: float        # the ordinary cut's (what no target gets)
    min_peak_bytes: float            # the smallest of the plans evaluated (all: when none fit)
    family: str                      # FAMILIES
    recompute_cost: float            # flops (re-gathers at their price)
    default_recompute_cost: float
    saved_bytes: float
    kept_gathers: int                # gathered weights the forward hands the backward
    candidates: int                  # distinct cuts on the hulls
    evaluated: int                   # of them built and simulated


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


def recomputed_ids(graph: fx_export.ExportedJointGraph, saved_ids: Iterable[int],
                   node_info: np.ndarray) -> np.ndarray:
    """Forward nodes the backward computes again under the cut that saves `saved_ids`: every
    non-backward node a backward node reaches through producers without passing a saved value
    or a primal (ascending)."""
    n = len(graph.nodes)
    producers: list[list[int]] = [[] for _ in range(n)]
    for t, h in zip(graph.edge_tails.tolist(), graph.edge_heads.tolist()):
        producers[h].append(t)
    backward = (node_info & _TANGENT_CLOSURE) != 0
    backward[np.asarray(graph.bwd_outputs, dtype=np.int64)] = True
    stop = np.array(backward, copy=True)
    stop[np.asarray(list(saved_ids), dtype=np.int64)] = True
    stop |= (np.asarray(graph.flags) & _PRIMAL) != 0
    seen = np.zeros(n, dtype=bool)
    stack = [p for v in np.flatnonzero(backward) for p in producers[v]]
    while stack:
        v = stack.pop()
        if seen[v] or stop[v]:
            continue
        seen[v] = True
        stack.extend(producers[v])
    return np.flatnonzero(seen)


def candidates(graph: fx_export.ExportedJointGraph, *, policy: str,
               mark_parameter_aliases: bool) -> list[Candidate]:
    """The ordinary cut and the hull vertices of both families (module docstring), distinct
    saved sets, in the choice order: ascending cost, then fewer saved bytes, family, ids."""
    costs = budget.recompute_costs(graph)
    save_bytes: Optional[np.ndarray] = None
    found: dict[tuple, Candidate] = {}

    def add(family, saved_ids, node_info, saved_bytes):
        key = tuple(int(i) for i in saved_ids)
        if key in found:
            return
        cost = float(costs[recomputed_ids(graph, key, node_info)].sum())
        found[key] = Candidate(family, key, cost, float(saved_bytes), node_info)

    cut = _C.partition_joint_graph(graph, policy=budget.POLICY[policy],
                                   mark_parameter_aliases=mark_parameter_aliases)
    families = [("re-gather", True), ("keep-gathered", False)] if mark_parameter_aliases else [
        ("keep-gathered", False)]
    sweeps = []
    for family, mark in families:
        sweep = budget.BudgetSweep(graph, policy=policy, mark_parameter_aliases=mark,
                                   recompute_cost=costs)
        if save_bytes is None:
            save_bytes = np.nan_to_num(sweep.save_bytes, posinf=0.0)
        sweeps.append((family, sweep))
    add("default", cut.saved_nodes, np.asarray(cut.node_info),
        float(sum(save_bytes[i] for i in cut.saved_nodes)))
    has_gathers = any(g.op == "call_function" and _is_parameter_gather(graph, i)
                      for i, g in enumerate(graph.nodes))
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
            add(family, point.saved_ids, info, point.saved_bytes)
        for lo, hi in zip(hull, hull[1:]):  # inside each edge (module docstring, 1.)
            for k in range(1, EDGE_POINTS + 1):
                budget_bytes = lo.saved_bytes + k * (hi.saved_bytes - lo.saved_bytes) / (
                    EDGE_POINTS + 1)
                point = sweep.choose(math.floor(budget_bytes)).point
                add(family, point.saved_ids, info, point.saved_bytes)
    order = {f: i for i, f in enumerate(FAMILIES)}
    return sorted(found.values(), key=lambda c: (c.recompute_cost, c.saved_bytes,
                                                 order[c.family], c.saved_ids))


def _is_parameter_gather(graph: fx_export.ExportedJointGraph, i: int) -> bool:
    """Node i gathers a parameter (a GATHER whose input is a parameter primal)."""
    if int(graph.op_class[i]) != int(OpClass.GATHER):
        return False
    ids = np.flatnonzero(graph.edge_heads == i)
    return any(int(graph.flags[graph.edge_tails[e]]) & _PARAMETER for e in ids)


def _thinned(cands: list[Candidate], limit: int) -> list[Candidate]:
    """At most `limit` candidates, evenly spread over the cost order, ends kept."""
    if len(cands) <= limit:
        return cands
    picks = sorted({round(k * (len(cands) - 1) / (limit - 1)) for k in range(limit)})
    return [cands[k] for k in picks]


def graph_peak(gm: fx.GraphModule, persistent_names: Iterable[str]) -> tuple[float, float]:
    """(simulated peak, bytes alive before the first node) of `gm` in its own order."""
    arrays = fx_arrays.graph_arrays(gm)
    memory = fx_arrays.memory_graph(gm, persistent_names, graph=arrays)
    is_input = np.asarray(memory.is_input)
    order = np.flatnonzero(is_input == 0).astype(np.int64)
    inputs = float(np.asarray(memory.bytes)[is_input != 0].sum())
    return float(_C.simulate_memory(memory, order=order).peak_bytes), inputs


def user_output_bytes(fw: fx.GraphModule, num_fwd_outputs: int) -> float:
    """Bytes of the forward's user outputs (its first num_fwd_outputs) that it computes: what
    the caller holds while the backward runs."""
    out = fw.graph.find_nodes(op="output")[0]
    leaves = pytree.arg_tree_leaves(*out.args)[:num_fwd_outputs]
    held = {x for x in leaves if isinstance(x, fx.Node) and x.op != "placeholder"}
    return float(sum(value_bytes(x.meta.get("val")) for x in held))


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


def evaluate(candidate: Candidate, build: Callable[[Candidate], tuple],
             parameter_names: set[str], num_fwd_outputs: int) -> Evaluation:
    """Builds `candidate` (build returns (fw, bw, ...) after every pass) and simulates it."""
    built = build(candidate)
    fw, bw = built[0], built[1]
    fw_peak, inputs = graph_peak(fw, parameter_names)
    bw_peak, _ = graph_peak(bw, parameter_names)
    bw_peak += user_output_bytes(fw, num_fwd_outputs)
    return Evaluation(candidate, built, max(fw_peak, bw_peak), fw_peak, bw_peak, inputs)


def plan(graph: fx_export.ExportedJointGraph, *, peak_target: float, policy: str,
         mark_parameter_aliases: bool, build: Callable[[Candidate], tuple],
         parameter_names: set[str], num_fwd_outputs: int) -> tuple[Evaluation, PlanSummary]:
    """The cheapest candidate whose simulated peak fits `peak_target` (module docstring), and
    its summary. build(candidate) -> (fw, bw, ...): the partitioner's extraction and passes.
    Raises PeakTargetInfeasibleError where none fits."""
    cands = candidates(graph, policy=policy, mark_parameter_aliases=mark_parameter_aliases)
    default = next(c for c in cands if c.family == "default")
    pool = _thinned(cands, MAX_EVALUATED)
    if default not in pool:
        pool = sorted([*pool[:-1], default], key=cands.index)
    done: dict[tuple, Evaluation] = {}

    def run(c: Candidate) -> Evaluation:
        if c.saved_ids not in done:
            done[c.saved_ids] = evaluate(c, build, parameter_names, num_fwd_outputs)
        return done[c.saved_ids]

    base = run(default)
    target = resolve_target(peak_target, base.peak_bytes)
    chosen = next((e for e in map(run, pool) if e.peak_bytes <= target), None)
    smallest = min(e.peak_bytes for e in done.values())
    if chosen is None:
        raise PeakTargetInfeasibleError(
            f"deepcompile_remat: peak_target {peak_target:g} asks for a simulated peak of "
            f"{target:,.0f} bytes for this graph ({len(graph.nodes)} nodes), but the smallest "
            f"any plan reaches is {smallest:,.0f} bytes ({smallest / base.peak_bytes:.3f} of "
            f"the ordinary cut's {base.peak_bytes:,.0f}; {len(done)} of {len(cands)} plans "
            f"simulated). Set peak_target to at least that, or shard or checkpoint more.",
            smallest)
    c = chosen.candidate
    kept = sum(1 for i in c.saved_ids if _is_parameter_gather(graph, i))
    summary = PlanSummary(
        target_bytes=target, predicted_peak_bytes=chosen.peak_bytes,
        forward_peak_bytes=chosen.forward_peak_bytes,
        backward_peak_bytes=chosen.backward_peak_bytes, inputs_bytes=chosen.inputs_bytes,
        default_peak_bytes=base.peak_bytes, min_peak_bytes=smallest, family=c.family,
        recompute_cost=c.recompute_cost, default_recompute_cost=default.recompute_cost,
        saved_bytes=c.saved_bytes, kept_gathers=kept, candidates=len(cands),
        evaluated=len(done))
    return chosen, summary
