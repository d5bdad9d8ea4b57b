"""The steps of one partition, as a library: clean the joint graph, decide a cut, extract the
forward and backward modules, describe what was decided. The planning layer
(deepcompile_remat/planning) runs them in order and puts the runtime's passes between them;
nothing here knows what a runtime does.

    clean_joint_graph(joint, config, torch_passes)      # DCE, CSE
    apply_force_save_rules(joint)                       # torch's rules that must hold
    graph = fx_export.export_joint_graph(joint, ...)    # arrays for the C++ core
    saved_ids, node_info, budget_summary = decide(graph, config)
    extracted = extract_cut(joint, graph, saved_ids, ...)
    rep = describe(graph, config, extracted, saved_ids, node_info, ...)
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.fx as fx

from deepcompile_remat import _C
from deepcompile_remat.config import RematConfig
from deepcompile_remat.fx_values import OP_NAMESPACE, observed_bytes, symbolic_bytes
from deepcompile_remat.partition import budget, cse, dce, extract, fx_export, report

PartitionConflictError = _C.PartitionConflictError
log = logging.getLogger(__name__)

_PARAMETER_ALIAS = int(_C.NodeInfoBit.PARAMETER_ALIAS)
_RECOMPUTE_REQUESTED = int(_C.NodeInfoBit.RECOMPUTE_REQUESTED)
_PARAMETER = int(_C.NodeFlag.PARAMETER)


def clean_joint_graph(joint_module: fx.GraphModule, config: RematConfig,
                      torch_passes: bool = False) -> None:
    """DCE and CSE in place (dce.py, cse.py; with torch_passes, FX's DCE and torch's
    fx_graph_cse, the passes ours replaced, for benchmarks)."""
    if torch_passes:
        from torch._functorch.compile_utils import fx_graph_cse

        joint_module.graph.eliminate_dead_code()
        if config.cse:
            joint_module.graph = fx_graph_cse(joint_module.graph)
    else:
        dce.eliminate_dead_code(joint_module)
        if config.cse:
            cse.eliminate_common_subexpressions(joint_module.graph)


def apply_force_save_rules(joint_module: fx.GraphModule) -> None:
    """torch's rules that must hold for correctness, whatever the cut: effectful ops and the
    source of a mutation repeated in backward are never recomputed."""
    from torch._functorch import partitioners as tp

    for rule in ("force_save_effectful_ops", "force_save_bw_mutation_src"):
        fn = getattr(tp, rule, None)
        if fn is not None:
            fn(joint_module)


def _collectives_of(tag: str, gm: fx.GraphModule) -> tuple[str, ...]:
    """'fw|bw:op:dtype:numel' for each collective node: what crosses the wire, per graph."""
    out = []
    for n in gm.graph.nodes:
        if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace in (
                OP_NAMESPACE, "_c10d_functional"):
            val = n.meta.get("val")
            vals = val if isinstance(val, (list, tuple)) else [val]
            tensors = [v for v in vals if isinstance(v, torch.Tensor)]
            desc = (f"{str(tensors[0].dtype).replace('torch.', '')}:"
                    f"{sum(t.numel() for t in tensors)}") if tensors else "?"
            out.append(f"{tag}:{n.target.name()}:{desc}")
    return tuple(out)


def conflict_message(err: Exception, graph: fx_export.ExportedJointGraph) -> str:
    """The C++ conflict `err` (node ids, reasons) as the chain of FX nodes it names."""
    lines = ["deepcompile_remat: the rematerialization constraints cannot all hold; "
             "along this chain of FX nodes:"]
    for node_id, reason in zip(err.nodes, err.reasons):
        node = graph.nodes[node_id]
        lines.append(f"  {node.name} = {node.format_node()}" + (f"   <- {reason}" if reason else ""))
    lines.append("Remove one of the conflicting tags (node.meta['recompute']) or the parameter "
                 "marking (RematConfig.mark_parameter_aliases) for these nodes.")
    return "\n".join(lines)


def _saved_value(node: fx.Node, parameter: bool) -> report.SavedValue:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return report.SavedValue(node.name, tuple(str(s) if not isinstance(s, int) else s
                                                  for s in val.shape),
                                 str(val.dtype).replace("torch.", ""),
                                 observed_bytes(val), parameter, symbolic_bytes(val))
    return report.SavedValue(node.name, (), type(val).__name__, 0, parameter)


def _is_replay(node: fx.Node) -> bool:
    return node.target is getattr(torch._prims.rng_prims, "run_with_rng_state", None)


def _recomputed_name(node: fx.Node) -> str:
    """A recomputed node's name; a random op replayed from its forward RNG state (extract.py)
    is named after the op it runs: 'native_dropout.default (RNG replayed)'."""
    if _is_replay(node):
        return f"{getattr(node.args[1], '__name__', node.args[1])} (RNG replayed)"
    return node.name


def _ops_of(gm: fx.GraphModule) -> tuple[str, ...]:
    return tuple(_target_name(n.target) for n in gm.graph.nodes if n.op == "call_function")


@functools.lru_cache(maxsize=None)
def _target_name(target) -> str:
    return str(target)  # an OpOverload formats its name on every str(): once per op here


def resolve_parameter_indices(joint_module, config, parameter_indices, num_graph_inputs,
                              static_lifetime_input_indices) -> Optional[Sequence[int]]:
    """The primals that are parameters: `parameter_indices` (else config.parameter_indices);
    None leaves it to AOTAutograd's static-lifetime inputs. Indices that count another number
    of inputs than the joint graph has primals fall back to those static inputs too."""
    if parameter_indices is not None and num_graph_inputs is not None:
        num_primals = sum(1 for n in joint_module.graph.nodes if fx_export.is_primal(n))
        if num_primals != num_graph_inputs:
            log.warning(
                "deepcompile_remat: the joint graph has %d primals but the backend saw %d graph "
                "inputs, so its parameter indices do not line up; marking AOTAutograd's "
                "static-lifetime inputs as the parameters instead.", num_primals, num_graph_inputs)
            return tuple(static_lifetime_input_indices or ())
    return parameter_indices if parameter_indices is not None else config.parameter_indices


def decide(graph: fx_export.ExportedJointGraph, config: RematConfig):
    """(saved node ids, node_info, BudgetSummary or None): the ordinary cut, or the budget
    mode's choice (partition/budget.py) when config.memory_budget is set."""
    try:
        if config.memory_budget is None:
            cut = _C.partition_joint_graph(
                graph, policy=budget.POLICY[config.policy],
                mark_parameter_aliases=config.mark_parameter_aliases)
            return cut.saved_nodes, cut.node_info, None
        saved_ids, node_info, decision, default_bytes = budget.decide(
            graph, memory_budget=config.memory_budget, policy=config.policy,
            mark_parameter_aliases=config.mark_parameter_aliases)
    except PartitionConflictError as err:
        raise PartitionConflictError(conflict_message(err, graph)) from err
    summary = report.BudgetSummary(
        saved_bytes_budget=decision.saved_bytes_budget, default_saved_bytes=default_bytes,
        saved_bytes=decision.point.saved_bytes,
        recompute_cost=decision.point.recompute_cost,
        hull_cost_at_budget=decision.hull_cost_at_budget,
        optimality_gap=decision.optimality_gap)
    log.info("deepcompile_remat: memory budget %.0f bytes: saves %.0f bytes, recomputes %.3g "
             "flops (at most %.3g above the best possible)", summary.saved_bytes_budget,
             summary.saved_bytes, summary.recompute_cost, summary.optimality_gap)
    return saved_ids, node_info, summary


@dataclass(frozen=True)
class Extracted:
    """A cut's forward and backward modules, before any runtime pass, and what they pass."""
    fw: fx.GraphModule
    bw: fx.GraphModule
    saved_tensors: tuple   # joint-graph nodes the forward hands over as tensors
    saved_sym: tuple       # ... as SymInts


def extract_cut(joint_module: fx.GraphModule, graph: fx_export.ExportedJointGraph,
                saved_ids: Sequence[int], *, num_fwd_outputs: int, static_nodes: set,
                torch_passes: bool = False) -> Extracted:
    """The modules of the cut that saves `saved_ids` (node ids of `graph`): saved values split
    into SymInts, opaque objects and tensors, then extract.py (torch's helper with
    torch_passes)."""
    extract_modules = (extract.torch_extract_fwd_bwd_modules if torch_passes
                       else extract.extract_fwd_bwd_modules)
    saved_nodes = [graph.nodes[i] for i in saved_ids]
    saved_sym = [n for n in saved_nodes if extract.is_sym_node(n)]
    saved_opaque = [n for n in saved_nodes if extract.is_opaque_node(n)]
    saved_tensors = [n for n in saved_nodes if n not in saved_sym and n not in saved_opaque]
    fw, bw = extract_modules(
        joint_module, saved_tensors, saved_sym, saved_opaque,
        num_fwd_outputs=num_fwd_outputs, static_lifetime_input_nodes=static_nodes)
    return Extracted(fw, bw, tuple(saved_tensors), tuple(saved_sym))


def parameter_names_of(graph: fx_export.ExportedJointGraph) -> set[str]:
    """The names of the primals flagged PARAMETER (ZeRO-3: shards, resident anyway)."""
    return {graph.nodes[i].name for i in np.flatnonzero(graph.flags & _PARAMETER)}


def static_nodes_of(joint_module: fx.GraphModule, static_indices: Sequence[int]) -> set:
    """The primals at AOTAutograd's static-lifetime input indices."""
    primals = [n for n in joint_module.graph.nodes if fx_export.is_primal(n)]
    wanted = set(static_indices)
    return {p for i, p in enumerate(primals) if i in wanted}


def describe(graph: fx_export.ExportedJointGraph, config: RematConfig, extracted: Extracted,
             saved_ids: Sequence[int], node_info: np.ndarray, *, parameter_names: set[str],
             timings: dict, schedule: tuple = (), runtime_summary: str = "",
             budget_summary: Optional[report.BudgetSummary] = None,
             plan: Any = None, offload: Any = None) -> report.PartitionReport:
    """The PartitionReport of one partition (timings: prepare_s, export_s, solve_s,
    extract_s; parameter_names: parameter_names_of(graph), which the caller has already);
    logs the saved values a checkpoint region asked to recompute."""
    fw_module, bw_module = extracted.fw, extracted.bw
    fw_names = {n.name for n in fw_module.graph.nodes if n.op == "call_function"}
    recomputed = tuple(_recomputed_name(n) for n in bw_module.graph.nodes
                       if n.op == "call_function" and (n.name in fw_names or _is_replay(n)))
    # Forward RNG states the backward replays (extract.py): saved values too.
    rng_states = [n for n in bw_module.graph.find_nodes(op="placeholder")
                  if n.name.startswith("rng_state_output")]
    against_request = tuple(graph.nodes[i].name for i in saved_ids
                            if node_info[i] & _RECOMPUTE_REQUESTED)
    if against_request:
        log.info("deepcompile_remat: a checkpoint region asked to recompute %s, but they are "
                 "saved: recomputing them is impossible (an effectful op, or an unseeded random "
                 "op, feeds them) or would force a constraint that cannot hold",
                 ", ".join(against_request))
    return report.PartitionReport(
        graph_nodes=len(graph.nodes),
        policy=config.policy,
        saved=tuple(_saved_value(n, n.name in parameter_names)
                    for n in [*extracted.saved_tensors, *rng_states]),
        saved_sym_names=tuple(n.name for n in extracted.saved_sym),
        recomputed=recomputed,
        parameter_aliases=tuple(graph.nodes[i].name
                                for i in np.flatnonzero(node_info & _PARAMETER_ALIAS)),
        saved_against_request=against_request,
        forward_ops=_ops_of(fw_module), backward_ops=_ops_of(bw_module),
        collectives=_collectives_of("fw", fw_module) + _collectives_of("bw", bw_module),
        schedule=schedule, runtime_summary=runtime_summary, budget=budget_summary, plan=plan,
        offload=offload, **timings)
