"""Memory-budget mode: the least recompute cost whose saved bytes fit a budget.

The C++ side (csrc/partition/budget_cut.h) sweeps a parametric min-cut over the default cut's
network and returns every vertex of the lower convex hull of (saved bytes, recompute cost);
a budget then picks a point on that hull. This module feeds it the joint graph fx_export builds
(a _C.JointGraph) plus a per-node recompute cost (a flops estimate, recompute_cost_of), reads
the C++ results (_C.CutPoint, _C.BudgetDecision, ...) by attribute, and maps node ids back to
FX nodes.

    graph = fx_export.export_joint_graph(joint, num_fwd_outputs=k, ...)
    sweep = BudgetSweep(graph, policy="conservative")
    decision = sweep.choose(resolve_budget(0.5, sweep.default_saved_bytes(),
                                           sweep.min_saved_bytes()))

The partitioner calls decide() when RematConfig.memory_budget is set; the report then
carries a BudgetSummary (partition/report.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.fx as fx

from deepcompile_remat import _C, fx_arrays
from deepcompile_remat.partition import cse, dce, fx_export

aten = torch.ops.aten
BudgetInfeasibleError = _C.BudgetInfeasibleError
# RematConfig.policy -> the C++ policy (the partitioner reads it from here too).
POLICY = {"conservative": _C.RematPolicy.conservative, "aggressive": _C.RematPolicy.aggressive}


# --- recompute cost --------------------------------------------------------------------------

def _numel(val) -> int:
    if isinstance(val, torch.Tensor):
        n = val.numel()
        return int(n) if isinstance(n, int) else int(_hint(n))
    if isinstance(val, (list, tuple)):
        return sum(_numel(v) for v in val)
    return 0


def _hint(x) -> int:
    from torch.fx.experimental import symbolic_shapes as ss

    hint = getattr(ss, "optimization_hint", None) or ss.hint_int
    return int(hint(x, fallback=8192))


def _dim(t: torch.Tensor, i: int) -> int:
    s = t.shape[i]
    return s if isinstance(s, int) else _hint(s)


def _val(x):
    return x.meta.get("val") if isinstance(x, fx.Node) else None


def _matmul_flops(target, node: fx.Node) -> Optional[int]:
    out = _val(node)
    if not isinstance(out, torch.Tensor):
        return None
    args = [_val(a) for a in node.args]
    if target in (aten.mm.default, aten.bmm.default):
        a = args[0]
        return 2 * _numel(out) * _dim(a, -1) if isinstance(a, torch.Tensor) else None
    if target in (aten.addmm.default, aten.baddbmm.default):
        a = args[1]
        return 2 * _numel(out) * _dim(a, -1) + _numel(out) if isinstance(a, torch.Tensor) else None
    if target is aten.convolution.default:
        x, w, transposed = args[0], args[1], node.args[6]
        if not isinstance(w, torch.Tensor):
            return None
        per_out = _numel(w) // max(_dim(w, 0), 1)  # C_in / groups * prod(kernel)
        if transposed and isinstance(x, torch.Tensor):
            return 2 * _numel(x) * per_out
        return 2 * _numel(out) * per_out
    return None


def _attention_flops(node: fx.Node) -> Optional[int]:
    name = str(node.target)
    if "scaled_dot_product" not in name and "flash_attention" not in name and (
            "efficient_attention" not in name):
        return None
    q, k = _val(node.args[0]), _val(node.args[1])
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)) or q.dim() < 2:
        return None
    # Q K^T and P V: 2 * 2 * (batch dims) * L * S * D.
    return 4 * _numel(q) * _dim(k, -2)


def recompute_cost_of(node: fx.Node) -> float:
    """What recomputing `node` costs, in flops: 2*m*n*k for mm/bmm/addmm/baddbmm, the usual
    count for convolutions and attention, and, for any other op, its output element count (a
    memory-bound op touches each element about once). Placeholders cost 0. Integers, so the
    C++ sweep's arithmetic stays exact (budget_cut.h, "Exactness")."""
    if node.op != "call_function":
        return 0.0
    price = node.meta.get(fx_arrays.RECOMPUTE_PRICE)
    if price is not None:  # a runtime's own estimate (fx_arrays.RECOMPUTE_PRICE)
        return float(price)
    flops = _matmul_flops(node.target, node)
    if flops is None:
        flops = _attention_flops(node)
    if flops is None:
        flops = _numel(_val(node))
    return float(flops)


def recompute_costs(graph: fx_export.ExportedJointGraph) -> np.ndarray:
    """recompute_cost_of per exported node (float64[n]); the C++ side reads it only for the
    nodes the policy bans from recomputation for cost reasons."""
    return np.asarray([recompute_cost_of(n) for n in graph.nodes], dtype=np.float64)


# --- the sweep ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class BudgetPoint:
    """One legal cut: what it saves and what the backward then recomputes."""
    saved_bytes: float
    recompute_cost: float
    saved: tuple[str, ...]       # FX node names, graph order
    recomputed: tuple[str, ...]  # FX node names, graph order
    saved_ids: np.ndarray
    recomputed_ids: np.ndarray


@dataclass(frozen=True)
class BudgetDecision:
    """The point chosen for a budget, and how far from optimal it can be: no cut within the
    budget costs less than hull_cost_at_budget."""
    point: BudgetPoint
    saved_bytes_budget: float
    vertex: int                # hull vertex index, -1 when the point lies inside an edge
    edge: int                  # hull edge walked, -1 at a vertex
    hull_cost_at_budget: float
    optimality_gap: float      # point.recompute_cost - hull_cost_at_budget >= 0


class BudgetSweep:
    """The parametric min-cut of one exported joint graph (C++ BudgetSolver), with FX names.

    recompute_cost defaults to recompute_costs(graph)."""

    def __init__(self, graph: fx_export.ExportedJointGraph, *, policy: str = "conservative",
                 mark_parameter_aliases: bool = True,
                 recompute_cost: Optional[np.ndarray] = None):
        self.graph = graph
        self.policy = policy
        self.mark_parameter_aliases = mark_parameter_aliases
        cost = recompute_costs(graph) if recompute_cost is None else recompute_cost
        self.recompute_cost = np.ascontiguousarray(cost, dtype=np.float64)
        self._solver = _C.BudgetSolver(graph, recompute_cost=self.recompute_cost,
                                       policy=POLICY[policy],
                                       mark_parameter_aliases=mark_parameter_aliases)

    def _point(self, cut: _C.CutPoint) -> BudgetPoint:
        names = lambda ids: tuple(self.graph.nodes[i].name for i in ids)  # noqa: E731
        return BudgetPoint(
            saved_bytes=float(cut.saved_bytes), recompute_cost=float(cut.recompute_cost),
            saved=names(cut.saved_nodes), recomputed=names(cut.recomputed_nodes),
            saved_ids=cut.saved_nodes, recomputed_ids=cut.recomputed_nodes)

    def hull(self) -> list[BudgetPoint]:
        """Every vertex of the lower convex hull, saved bytes ascending (cost descending)."""
        return [self._point(v) for v in self._solver.hull().vertices]

    def edge_lambdas(self) -> np.ndarray:
        """Slope of each hull edge: bytes saved per unit of recompute cost."""
        return self._solver.hull().edge_lambda

    def choose(self, saved_bytes_budget: float) -> BudgetDecision:
        """The least-cost cut whose saved bytes fit saved_bytes_budget (budget_cut.h, "Choice").
        Raises BudgetInfeasibleError (a ValueError; .min_bytes) below the smallest feasible."""
        d = self._solver.choose(float(saved_bytes_budget))
        return BudgetDecision(
            point=self._point(d.point), saved_bytes_budget=float(d.saved_bytes_budget),
            vertex=d.vertex,
            edge=d.edge, hull_cost_at_budget=d.hull_cost_at_budget,
            optimality_gap=d.optimality_gap)

    def evaluate(self, saved_ids) -> BudgetPoint:
        """The point of a given legal saved set (node ids): its bytes, and the nodes the
        backward recomputes with their cost (budget_cut.h, Evaluate). ValueError for a set
        no legal cut saves."""
        return self._point(self._solver.evaluate(np.asarray(saved_ids, dtype=np.int64)))

    def solve_at(self, lambda_: float) -> tuple[BudgetPoint, np.ndarray]:
        """Source-minimal min cut of bytes + lambda * cost, and its forward side per node."""
        cut = self._solver.solve_at(float(lambda_))
        return self._point(cut.point), cut.forward_side

    @property
    def save_bytes(self) -> np.ndarray:
        """Per node: bytes saving it costs (inf: it may not be saved)."""
        return self._solver.save_bytes

    @property
    def recompute_price(self) -> np.ndarray:
        """Per node: the recompute price the cut uses (inf: it may not be recomputed)."""
        return self._solver.recompute_price

    @property
    def node_info(self) -> np.ndarray:
        """Per node: dcr::NodeInfoBit flags (parameter aliases, tangent closure, ...)."""
        return self._solver.node_info

    @property
    def one_forward_cost(self) -> float:
        """Recompute cost of one whole forward (sum over the priced nodes)."""
        return self._solver.one_forward_cost

    def min_saved_bytes(self) -> float:
        """Saved bytes of the smallest legal cut (the hull's low end): the least any budget
        can get."""
        return self.hull()[0].saved_bytes

    def default_saved_bytes(self) -> float:
        """Saved bytes (1x, static inputs free) of the default cut under the same policy: what
        a fractional budget is a fraction of."""
        cut = _C.partition_joint_graph(self.graph, policy=POLICY[self.policy],
                                       mark_parameter_aliases=self.mark_parameter_aliases)
        save_bytes = self.save_bytes  # one copy out of C++, not one per saved node
        return float(sum(save_bytes[i] for i in cut.saved_nodes))


def resolve_budget(memory_budget: float, default_saved_bytes: float,
                   min_saved_bytes: float) -> float:
    """Budget in bytes (RematConfig.memory_budget). A number <= 1 is a fraction of what the
    default cut saves, raised to min_saved_bytes (the smallest legal cut's) where it falls
    below: as with torch's activation_memory_budget, a fraction never fails, and 0 asks for
    the least memory. A number > 1 is bytes per graph, taken as it is: below min_saved_bytes
    the choice raises BudgetInfeasibleError naming that minimum (a byte count is a limit the
    caller set; quietly exceeding it would hide that it cannot hold)."""
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)):
        raise TypeError(f"memory_budget must be a number, got {type(memory_budget).__name__}")
    if not math.isfinite(memory_budget) or memory_budget < 0:
        raise ValueError(f"memory_budget must be >= 0 and finite, got {memory_budget}")
    if memory_budget <= 1:
        return max(float(math.floor(memory_budget * default_saved_bytes)), min_saved_bytes)
    return float(math.floor(memory_budget))


def decide(graph: fx_export.ExportedJointGraph, *, memory_budget: float, policy: str,
           mark_parameter_aliases: bool) -> tuple[np.ndarray, np.ndarray, BudgetDecision, float]:
    """The partitioner's budget-mode decision: (saved node ids, node_info, BudgetDecision,
    the default cut's saved bytes). Raises BudgetInfeasibleError for a byte budget below the
    smallest feasible one (resolve_budget)."""
    sweep = BudgetSweep(graph, policy=policy, mark_parameter_aliases=mark_parameter_aliases)
    default = sweep.default_saved_bytes()
    decision = sweep.choose(resolve_budget(memory_budget, default, sweep.min_saved_bytes()))
    return decision.point.saved_ids, sweep.node_info, decision, default


# --- tracing helpers ---------------------------------------------------------------------------

def trace_joint_graph(fn: Callable, args: Sequence[torch.Tensor], *,
                      parameter_indices: Sequence[int] = ()) -> fx_export.ExportedJointGraph:
    """AOTAutograd's joint graph of fn(*args), exported (fx_export) with `parameter_indices`
    as the static-lifetime parameters. Runs fn once through aot_function; the captured joint
    is DCE'd and CSE'd as the partitioner does (dce.py, cse.py)."""
    from functorch.compile import aot_function, default_partition, make_boxed_func

    captured = {}

    def capture(joint, joint_inputs, *, num_fwd_outputs, **kw):
        dce.eliminate_dead_code(joint)
        cse.eliminate_common_subexpressions(joint.graph)
        joint.recompile()
        captured["graph"] = fx_export.export_joint_graph(
            joint, num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=parameter_indices, parameter_indices=parameter_indices)
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)

    nop = lambda gm, _: make_boxed_func(gm.forward)  # noqa: E731
    aot_function(fn, fw_compiler=nop, bw_compiler=nop, partition_fn=capture)(*args)
    return captured["graph"]
