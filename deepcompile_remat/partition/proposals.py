"""Cuts to choose from: the ordinary cut and the vertices and edges of the parametric min-cut
hulls (budget.py's sweep), with and without the ZeRO-3 marking.

    cands = candidates(graph, policy="conservative", mark_parameter_aliases=True)

Each Candidate is a saved set, its family and its recompute cost:
- "default": the ordinary cut;
- "re-gather": a vertex (or a point inside an edge) of the hull with the marking: every
  gathered weight is re-gathered in the backward; the hull trades saved activations against
  recomputation;
- "keep-gathered": the same without the marking: a gathered weight may be kept from the
  forward (DeepCompile's selective unsharding). Re-gathering it is priced at its gathered
  bytes (fx_arrays.RECOMPUTE_PRICE, set by the runtime), so the hull chooses per weight which
  to keep, the cheapest per byte first. Every gather costs the same per byte, so keeping some
  of them lies inside one edge: EDGE_POINTS cuts inside each edge are candidates too.
Only graphs with parameter gathers have the second family. Cost: the flops the backward
recomputes (budget.recompute_cost_of, re-gathers at their price). The order is ascending
cost, then fewer saved bytes, the family order, the node ids: a pure function of the graph,
the same on every rank. Which candidate to take is the planning layer's choice
(deepcompile_remat/planning).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from deepcompile_remat import _C
from deepcompile_remat.partition import budget, fx_export
from deepcompile_remat.partition.op_classes import OpClass

_PARAMETER = int(_C.NodeFlag.PARAMETER)
FAMILIES = ("default", "re-gather", "keep-gathered")  # tie-break order (module docstring)
EDGE_POINTS = 3  # cuts taken inside each hull edge, at even steps of its saved bytes


@dataclass(frozen=True)
class Candidate:
    """One cut the planning layer may pick: its family, saved node ids and recompute cost."""
    family: str
    saved_ids: tuple[int, ...]
    recompute_cost: float
    saved_bytes: float
    node_info: np.ndarray  # the node_info of the solve it came from (aliases, regions)


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
        for lo, hi in zip(hull, hull[1:]):  # inside each edge (module docstring)
            for k in range(1, EDGE_POINTS + 1):
                saved_bytes_budget = lo.saved_bytes + k * (hi.saved_bytes - lo.saved_bytes) / (
                    EDGE_POINTS + 1)
                add(family, sweep.choose(math.floor(saved_bytes_budget)).point, info)
    order = {f: i for i, f in enumerate(FAMILIES)}
    return sorted(found.values(), key=lambda c: (c.recompute_cost, c.saved_bytes,
                                                 order[c.family], c.saved_ids))


def parameter_gathers(graph: fx_export.ExportedJointGraph) -> np.ndarray:
    """bool[n]: node i gathers a parameter (a GATHER that reads a parameter primal)."""
    reads_parameter = np.zeros(len(graph.nodes), dtype=bool)
    tails, heads = np.asarray(graph.edge_tails), np.asarray(graph.edge_heads)
    reads_parameter[heads[(np.asarray(graph.flags)[tails] & _PARAMETER) != 0]] = True
    return reads_parameter & (np.asarray(graph.op_class) == int(OpClass.GATHER))
