"""remat_partition_fn: AOTAutograd's partition contract, decided by the C++ min-cut.

    partition_fn = remat_partition_fn(config, hooks=...)
    fw_module, bw_module = partition_fn(joint_module, joint_inputs, num_fwd_outputs=k)

Steps: clean the joint graph (DCE, CSE, hooks' joint rewrites, torch's force-save rules for
effectful ops and backward mutations) -> export it as arrays (fx_export) -> solve in C++
(csrc/partition) -> split saved values into SymInts / opaque objects / tensors -> build the
two modules (extract.py: our extraction, torch's helper where ours steps aside) -> hooks'
passes over the two modules -> record a PartitionReport.

Hooks (PartitionHook) are how a runtime adds graph passes around the cut without the
partitioner knowing it: the ZeRO-3 runtime plugs in this way (zero3/hooks.py, composed in
backends.py).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np
import torch
import torch.fx as fx

from deepcompile_remat import _C
from deepcompile_remat.config import RematConfig
from deepcompile_remat.fx_values import OP_NAMESPACE, observed_bytes, symbolic_bytes
from deepcompile_remat.partition import budget, cse, dce, extract, fx_export, planner, report

PartitionConflictError = _C.PartitionConflictError
log = logging.getLogger(__name__)

_PARAMETER_ALIAS = int(_C.NodeInfoBit.PARAMETER_ALIAS)
_RECOMPUTE_REQUESTED = int(_C.NodeInfoBit.RECOMPUTE_REQUESTED)
_PARAMETER = int(_C.NodeFlag.PARAMETER)

class PartitionHook(Protocol):
    """How a runtime adds graph passes around the cut without the partitioner knowing it
    (the ZeRO-3 runtime: zero3/hooks.py::Zero3Hooks)."""

    def rewrite_joint(self, joint: fx.GraphModule, num_fwd_outputs: int) -> None:
        """Rewrites the joint graph in place before it is cut (its first num_fwd_outputs
        outputs are the forward's)."""

    def after_extract(self, fw: fx.GraphModule, bw: fx.GraphModule,
                      parameter_names: set[str], *, bucket_bytes: Optional[float] = None
                      ) -> tuple:
        """Rewrites the forward and backward modules in place; returns figures for the
        report (PartitionReport.schedule): one immutable object per graph it touched.
        bucket_bytes: collective buckets of this size instead of the configured one (what
        peak-target mode tries; None: as configured)."""


def _prepare_joint_graph(joint_module: fx.GraphModule, config: RematConfig,
                         hooks: Sequence[PartitionHook], torch_passes: bool,
                         num_fwd_outputs: int) -> None:
    """DCE and CSE (FX's and torch's rules, in place: dce.py, cse.py; FX's and torch's own
    passes with torch_passes), the hooks' joint rewrites, then torch's force-save rules."""
    if torch_passes:
        from torch._functorch.compile_utils import fx_graph_cse

        joint_module.graph.eliminate_dead_code()
        if config.cse:
            joint_module.graph = fx_graph_cse(joint_module.graph)
    else:
        dce.eliminate_dead_code(joint_module)
        if config.cse:
            cse.eliminate_common_subexpressions(joint_module.graph)
    for hook in hooks:
        hook.rewrite_joint(joint_module, num_fwd_outputs)
    from torch._functorch import partitioners as tp

    # torch's rules that must hold for correctness, whatever the cut: effectful ops and the
    # source of a mutation repeated in backward are never recomputed.
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


def _conflict_message(err: Exception, graph: fx_export.ExportedJointGraph) -> str:
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
    return tuple(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


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


def partition_joint_graph(
    joint_module: fx.GraphModule,
    joint_inputs: Sequence[Any],
    *,
    num_fwd_outputs: int,
    config: RematConfig,
    static_lifetime_input_indices: Optional[Sequence[int]] = None,
    parameter_indices: Optional[Sequence[int]] = None,
    num_graph_inputs: Optional[int] = None,
    hooks: Sequence[PartitionHook] = (),
    torch_passes: bool = False,
    fuses_pointwise: bool = True,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """num_graph_inputs: how many inputs `parameter_indices` counts (the backend's example
    inputs); where the joint graph has another number of primals (effect tokens, flattened
    tensor subclasses), those indices would name the wrong primals. hooks: graph passes
    around the cut (PartitionHook). torch_passes: clean and extract with the passes ours
    replaced (FX's DCE, torch's fx_graph_cse and extraction helper), the same cut otherwise;
    bench-partition measures "before" against "after" with it. fuses_pointwise: the
    compiler fuses pointwise ops (inductor), for peak-target mode's memory simulation."""
    # Lazy GraphModules (as inductor compiles them): code is generated on first call, not here.
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    parameter_indices = resolve_parameter_indices(
        joint_module, config, parameter_indices, num_graph_inputs, static_lifetime_input_indices)
    with _use_lazy_graph_module(True):
        return _partition_joint_graph(
            joint_module, num_fwd_outputs=num_fwd_outputs, config=config,
            static_lifetime_input_indices=static_lifetime_input_indices,
            parameter_indices=parameter_indices, hooks=tuple(hooks), torch_passes=torch_passes,
            fuses_pointwise=fuses_pointwise)


def _decide(graph, config: RematConfig):
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
        raise PartitionConflictError(_conflict_message(err, graph)) from err
    summary = report.BudgetSummary(
        budget_bytes=decision.budget_bytes, default_saved_bytes=default_bytes,
        saved_bytes=decision.point.saved_bytes,
        recompute_cost=decision.point.recompute_cost,
        hull_cost_at_budget=decision.hull_cost_at_budget,
        optimality_gap=decision.optimality_gap)
    log.info("deepcompile_remat: memory budget %.0f bytes: saves %.0f bytes, recomputes %.3g "
             "flops (at most %.3g above the best possible)", summary.budget_bytes,
             summary.saved_bytes, summary.recompute_cost, summary.optimality_gap)
    return saved_ids, node_info, summary


def _partition_joint_graph(joint_module, *, num_fwd_outputs, config, static_lifetime_input_indices,
                           parameter_indices, hooks, torch_passes, fuses_pointwise):
    t_start = time.perf_counter()
    _prepare_joint_graph(joint_module, config, hooks, torch_passes, num_fwd_outputs)
    t0 = time.perf_counter()
    static = list(static_lifetime_input_indices or ())
    graph = fx_export.export_joint_graph(
        joint_module, num_fwd_outputs=num_fwd_outputs, static_lifetime_input_indices=static,
        parameter_indices=parameter_indices)
    t1 = time.perf_counter()
    parameter_names = {graph.nodes[i].name
                       for i in np.flatnonzero(graph.flags & _PARAMETER)}
    primals = [n for n in joint_module.graph.nodes if fx_export.is_primal(n)]
    static_nodes = {p for i, p in enumerate(primals) if i in set(static)}
    extract_modules = (extract.torch_extract_fwd_bwd_modules if torch_passes
                       else extract.extract_fwd_bwd_modules)

    def build(saved_ids, bucket_bytes=None):
        """(fw, bw, schedule figures, saved tensors, saved symbols): the modules of the cut
        that saves saved_ids, after the hooks' passes (with buckets of bucket_bytes, if
        given)."""
        saved_nodes = [graph.nodes[i] for i in saved_ids]
        saved_sym = [n for n in saved_nodes if extract.is_sym_node(n)]
        saved_opaque = [n for n in saved_nodes if extract.is_opaque_node(n)]
        saved_tensors = [n for n in saved_nodes if n not in saved_sym and n not in saved_opaque]
        fw, bw = extract_modules(
            joint_module, saved_tensors, saved_sym, saved_opaque,
            num_fwd_outputs=num_fwd_outputs, static_lifetime_input_nodes=static_nodes)
        # bucket_bytes only where asked: a hook written before it existed still plugs in.
        extra = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
        figures = tuple(f for hook in hooks
                        for f in hook.after_extract(fw, bw, parameter_names, **extra))
        return fw, bw, figures, saved_tensors, saved_sym

    plan_summary = None
    if config.peak_target is None:
        saved_ids, node_info, budget_summary = _decide(graph, config)
        t2 = time.perf_counter()
        built = build(saved_ids)
    else:
        t2 = time.perf_counter()
        budget_summary = None
        try:
            chosen, plan_summary = planner.plan(
                graph, peak_target=config.peak_target, policy=config.policy,
                mark_parameter_aliases=config.mark_parameter_aliases,
                build=lambda c, bucket_bytes=None: build(c.saved_ids, bucket_bytes),
                bucket_bytes=float(config.bucket_bytes), parameter_names=parameter_names,
                fuses_pointwise=fuses_pointwise)
        except PartitionConflictError as err:
            raise PartitionConflictError(_conflict_message(err, graph)) from err
        saved_ids, node_info, built = chosen.candidate.saved_ids, chosen.candidate.node_info, \
            chosen.built
        log.info("deepcompile_remat: peak target %.0f bytes: plan %s, simulated peak %.0f "
                 "bytes (ordinary cut %.0f), recomputes %.3g flops; %d of %d plans simulated",
                 plan_summary.target_bytes, plan_summary.family,
                 plan_summary.predicted_peak_bytes, plan_summary.default_peak_bytes,
                 plan_summary.recompute_cost, plan_summary.evaluated, plan_summary.candidates)
    fw_module, bw_module, schedule, saved_tensors, saved_sym = built
    t3 = time.perf_counter()

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
    rep = report.PartitionReport(
        graph_nodes=len(graph.nodes),
        policy=config.policy,
        saved=tuple(_saved_value(n, n.name in parameter_names)
                    for n in [*saved_tensors, *rng_states]),
        saved_sym_names=tuple(n.name for n in saved_sym),
        recomputed=recomputed,
        parameter_aliases=tuple(graph.nodes[i].name
                                for i in np.flatnonzero(node_info & _PARAMETER_ALIAS)),
        saved_against_request=against_request,
        prepare_s=t0 - t_start, export_s=t1 - t0, solve_s=t2 - t1, extract_s=t3 - t2,
        forward_ops=_ops_of(fw_module), backward_ops=_ops_of(bw_module),
        collectives=_collectives_of("fw", fw_module) + _collectives_of("bw", bw_module),
        schedule=schedule, budget=budget_summary, plan=plan_summary)
    report.record(rep, config.keep_reports)
    return fw_module, bw_module


def remat_partition_fn(
    config: RematConfig,
    *,
    parameter_indices: Optional[Sequence[int]] = None,
    num_graph_inputs: Optional[int] = None,
    hooks: Sequence[PartitionHook] = (),
    torch_passes: bool = False,
    fuses_pointwise: bool = True,
) -> Callable[..., tuple[fx.GraphModule, fx.GraphModule]]:
    """Our (remat) min-cut partition function with AOTAutograd's contract, bound to `config`;
    it runs whatever config.enabled says. The public deepcompile_remat.make_partition_fn is
    the one callers use: it holds the off switch (torch's partitioner) and plugs in the ZeRO-3
    hooks. parameter_indices (default: config.parameter_indices, else
    AOTAutograd's static-lifetime inputs) count the num_graph_inputs inputs a backend saw;
    hooks add graph passes; torch_passes swaps in torch's cleaning and extraction (for
    benchmarks); see partition_joint_graph."""

    def partition_fn(joint_module, joint_inputs, *, num_fwd_outputs,
                     static_lifetime_input_indices=None, **_unused):
        return partition_joint_graph(
            joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs, config=config,
            static_lifetime_input_indices=static_lifetime_input_indices,
            parameter_indices=parameter_indices, num_graph_inputs=num_graph_inputs, hooks=hooks,
            torch_passes=torch_passes, fuses_pointwise=fuses_pointwise)

    return partition_fn
