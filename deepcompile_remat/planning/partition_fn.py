"""The partition function AOTAutograd calls: the planning layer above the cut and the runtime.

    partition_fn = remat_partition_fn(config, topology=topology)
    fw_module, bw_module = partition_fn(joint_module, joint_inputs, num_fwd_outputs=k)

One call plans one joint graph, in this order:
1. clean it (partition/cut.py: DCE, CSE), then the runtime's joint rewrites (zero3/runtime.py,
   built here from the config and the process-group Topology), then torch's force-save rules;
2. export it as arrays (partition/fx_export.py);
3. resolve the runtime's settings: bucket sizes "auto" (the default) are read from the graph,
   one collective per layer and direction (zero3/unit_buckets.py);
4. decide by the config's mode: the ordinary cut or memory_budget (partition/cut.py::decide,
   the settings of 3.), or peak_target (peak_target.py: cuts and larger buckets searched
   together); where the graph's collectives span ranks, every rank runs the cut (or
   peak_target's plan) the first rank made for this graph structure, and with a prefetch
   byte budget that rank's prefetch distances (agreement.py);
5. extract the chosen cut and run the runtime's passes with the chosen settings, then, with
   offload_activations, move saved activations to the host (partition/offload.py; inside
   every plan peak-target mode builds, so its simulated peaks count accelerator bytes only);
   for inductor, shape the backward's casts that only feed matmuls so that none compiles to
   a kernel of its own (partition/matmul_casts.py);
6. record a PartitionReport (what "auto" chose is in its summary line).
Settings go one way: RematConfig -> Zero3Runtime.settings -> 3. (and, in peak-target mode, a
larger bucket_bytes) -> runtime.rewrite -> the C++ schedule. Nothing calls back to override
them.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch.fx as fx

from deepcompile_remat.config import RematConfig
from deepcompile_remat.partition import (budget, cut, fx_export, layouts, matmul_casts, offload,
                                         report)
from deepcompile_remat.partition.simulate import step_peak
from deepcompile_remat.planning import agreement, peak_target
from deepcompile_remat.zero3.runtime import Zero3Runtime, summary_of
from deepcompile_remat.zero3.topology import Topology, topology_of
from deepcompile_remat.zero3.unit_buckets import resolve_auto


def partition_joint_graph(
    joint_module: fx.GraphModule,
    joint_inputs: Sequence[Any],
    *,
    num_fwd_outputs: int,
    config: RematConfig,
    static_lifetime_input_indices: Optional[Sequence[int]] = None,
    parameter_indices: Optional[Sequence[int]] = None,
    num_graph_inputs: Optional[int] = None,
    topology: Optional[Topology] = None,
    torch_passes: bool = False,
    fuses_pointwise: bool = True,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Plans and partitions one joint graph (module docstring). num_graph_inputs: how many
    inputs `parameter_indices` counts (the backend's example inputs); where the joint graph
    has another number of primals, those indices would name the wrong primals. topology: the
    process-group layout the runtime's passes read (None: read now from the groups the joint
    graph names). torch_passes: clean and extract with the passes ours replaced (FX's DCE,
    torch's fx_graph_cse and extraction helper), the same cut otherwise; bench-partition
    measures "before" against "after" with it. fuses_pointwise: the compiler is inductor,
    which fuses pointwise ops (peak-target mode's memory simulation) and saves a conv net's
    weights as channels-last copies (partition/layouts.py: the cut prices those copies)."""
    # Lazy GraphModules (as inductor compiles them): code is generated on first call, not here.
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    parameter_indices = cut.resolve_parameter_indices(
        joint_module, config, parameter_indices, num_graph_inputs, static_lifetime_input_indices)
    runtime = Zero3Runtime(config, topology if topology is not None else topology_of(joint_module))
    with _use_lazy_graph_module(True):
        return _plan(joint_module, num_fwd_outputs=num_fwd_outputs, config=config,
                     static=list(static_lifetime_input_indices or ()),
                     parameter_indices=parameter_indices, runtime=runtime,
                     torch_passes=torch_passes, fuses_pointwise=fuses_pointwise)


def _plan(joint_module, *, num_fwd_outputs, config, static, parameter_indices, runtime,
          torch_passes, fuses_pointwise):
    t_start = time.perf_counter()
    cut.clean_joint_graph(joint_module, config, torch_passes)
    runtime.rewrite_joint(joint_module, num_fwd_outputs)
    cut.apply_force_save_rules(joint_module)
    t0 = time.perf_counter()
    if fuses_pointwise:  # inductor: the conv weights it would save as channels-last copies
        layouts.mark_copied_when_saved(joint_module, num_fwd_outputs)
    graph = fx_export.export_joint_graph(
        joint_module, num_fwd_outputs=num_fwd_outputs, static_lifetime_input_indices=static,
        parameter_indices=parameter_indices)
    t1 = time.perf_counter()
    parameter_names = cut.parameter_names_of(graph)
    static_nodes = cut.static_nodes_of(joint_module, static)
    settings, auto = resolve_auto(runtime.settings, joint_module)

    offloads = _offloader(config, graph, num_fwd_outputs, parameter_names, fuses_pointwise)

    def build(saved_ids, settings):
        """(fw, bw, extracted, figures, offload figures or None): the cut that saves saved_ids,
        after the runtime's passes (and activation offload)."""
        extracted = cut.extract_cut(joint_module, graph, saved_ids,
                                    num_fwd_outputs=num_fwd_outputs, static_nodes=static_nodes,
                                    torch_passes=torch_passes)
        figures = runtime.rewrite(extracted.fw, extracted.bw, parameter_names, settings)
        moved = offloads(extracted) if offloads is not None else None
        return extracted.fw, extracted.bw, extracted, figures, moved

    plan_summary = budget_summary = buckets = distances = None
    spans_ranks = runtime.topology.spans_ranks()
    context = f"{config!r};{runtime.topology.shape()}"  # what the agreement key adds
    if config.peak_target is None:  # the ordinary cut or memory_budget's: one per structure
        (saved_ids, node_info, budget_summary, _, _), cut_by_rank, agreed_under = \
            agreement.agreed_cut(graph, agreement.Cut(*cut.decide(graph, config)),
                                 context=context, spans_ranks=spans_ranks)
        t2 = time.perf_counter()
        built = build(saved_ids, settings)
        used = settings
    else:
        t2 = time.perf_counter()
        try:
            chosen, plan_summary = peak_target.plan(
                graph, peak_target=config.peak_target, policy=config.policy,
                mark_parameter_aliases=config.mark_parameter_aliases,
                settings=settings,
                build=lambda c, settings: build(c.saved_ids, settings),
                parameter_names=parameter_names, fuses_pointwise=fuses_pointwise)
        except cut.PartitionConflictError as err:
            raise cut.PartitionConflictError(cut.conflict_message(err, graph)) from err
        own = agreement.Cut(chosen.candidate.saved_ids, chosen.candidate.node_info,
                            plan=plan_summary, buckets=(chosen.settings.bucket_bytes,
                                                        chosen.settings.grad_bucket_bytes))
        taken, cut_by_rank, agreed_under = agreement.agreed_cut(
            graph, own, context=context, spans_ranks=spans_ranks)
        saved_ids, node_info, buckets, built = taken.saved, taken.info, taken.buckets, chosen.built
        used = settings.with_bucket_bytes(*buckets)
        if not taken.same_choice(own):  # another rank's plan: built and simulated here
            built = build(saved_ids, used)
            plan_summary = peak_target.taken_plan(taken.plan, plan_summary, built,
                                                  parameter_names, fuses_pointwise)
        peak_target.log_plan(plan_summary)
    if agreed_under is not None and config.prefetch_budget_bytes >= 0 and built[3]:
        # the budget's distances read this rank's sizes: the first rank's run (agreement.py)
        own_distances = tuple(f.prefetch_distance for f in built[3])
        distances = agreement.agreed_distances(agreed_under, own_distances)
        if distances != own_distances:
            built = build(saved_ids, dataclasses.replace(used, prefetch_distances=distances))
    fw, bw, extracted, figures, moved = built
    if fuses_pointwise:  # inductor: no kernel of its own for a backward cast feeding matmuls
        matmul_casts.shape_matmul_casts(bw)
    t3 = time.perf_counter()
    rep = cut.describe(graph, config, extracted, saved_ids, node_info,
                       parameter_names=parameter_names,
                       timings=dict(prepare_s=t0 - t_start, export_s=t1 - t0, solve_s=t2 - t1,
                                    extract_s=t3 - t2),
                       schedule=figures,
                       runtime_summary=summary_of(figures) + (auto.summary() if auto and figures
                                                              else ""),
                       budget_summary=budget_summary, plan=plan_summary, offload=moved)
    agreed = None if agreed_under is None else (
        agreed_under, tuple(int(i) for i in saved_ids), np.asarray(node_info, np.uint8).tobytes(),
        buckets, distances)
    report.record(dataclasses.replace(rep, cut_by_rank=cut_by_rank, agreed=agreed),
                  config.keep_reports)
    return fw, bw


def _offloader(config: RematConfig, graph, num_fwd_outputs: int, parameter_names: set,
               fuses_pointwise: bool) -> Optional[Callable]:
    """With offload_activations: extracted -> OffloadFigures, moving the chosen saved values
    of a built cut to the host (with the simulated step peak before and after); else None."""
    if not config.offload_activations:
        return None
    step_flops = float(budget.recompute_costs(graph).sum())

    def peak(extracted) -> float:  # as peak-target mode's plans are simulated
        return step_peak(extracted.fw, extracted.bw, parameter_names, fuses_pointwise)[0]

    def run(extracted) -> offload.OffloadFigures:
        chosen, candidates = offload.choose(
            extracted.fw, [n.name for n in extracted.saved_tensors],
            num_fwd_outputs=num_fwd_outputs, parameter_names=parameter_names,
            flops_per_byte=config.host_link_flops_per_byte, step_flops=step_flops)
        before = peak(extracted) if chosen else 0.0
        figures = offload.apply(extracted.fw, extracted.bw, chosen,
                                num_fwd_outputs=num_fwd_outputs,
                                flops_per_byte=config.host_link_flops_per_byte,
                                candidates=candidates)
        after = peak(extracted) if chosen else 0.0
        return dataclasses.replace(figures, simulated_peak_before=before,
                                   simulated_peak_after=after)

    return run


def remat_partition_fn(
    config: RematConfig,
    *,
    parameter_indices: Optional[Sequence[int]] = None,
    num_graph_inputs: Optional[int] = None,
    topology: Optional[Topology] = None,
    torch_passes: bool = False,
    fuses_pointwise: bool = True,
) -> Callable[..., tuple[fx.GraphModule, fx.GraphModule]]:
    """Our partition function with AOTAutograd's contract, bound to `config`; it runs whatever
    config.enabled says. The public deepcompile_remat.make_partition_fn is the one callers
    use: it holds the off switch (torch's partitioner). parameter_indices (default:
    config.parameter_indices, else AOTAutograd's static-lifetime inputs) count the
    num_graph_inputs inputs a backend saw; see partition_joint_graph for the rest."""

    def partition_fn(joint_module, joint_inputs, *, num_fwd_outputs,
                     static_lifetime_input_indices=None, **_unused):
        return partition_joint_graph(
            joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs, config=config,
            static_lifetime_input_indices=static_lifetime_input_indices,
            parameter_indices=parameter_indices, num_graph_inputs=num_graph_inputs,
            topology=topology, torch_passes=torch_passes, fuses_pointwise=fuses_pointwise)

    return partition_fn
