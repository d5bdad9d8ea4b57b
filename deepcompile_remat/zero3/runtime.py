"""The ZeRO-3 runtime's graph passes around the cut, built once from RematConfig and a Topology.

    runtime = Zero3Runtime(config, topology)            # planning/ builds one per compile
    runtime.rewrite_joint(joint, num_fwd_outputs)       # before the cut
    figures = runtime.rewrite(fw, bw, parameter_names, runtime.settings)  # after extraction

rewrite_joint: cast-before-gather (so the backward's re-gathers are downcast too), each
gather's re-gather price, node-local re-gathers from secondary shards (zero3/passes.py; the
secondary groups come from the Topology, never from module tables). rewrite: points the
backward's remaining re-gathers at the secondary shards, reorders the forward and backward (the
C++ re-gather schedule, buckets, async prefetch), buckets the backward's gradient
reduce-scatters (grad_buckets.py), splits them into start/wait pairs (scatter_overlap.py), and
returns one ScheduleFigures per graph. What the collectives allocate inside their call is
priced into the nodes (scratch.py) before the first of those passes and again as they make
new nodes, so each pass's memory simulation counts it. `settings` is explicit: the planning
layer passes the configured ones (runtime.settings) or the ones it is trying (peak-target
mode's bucket sizes).
Both do nothing on a graph without our ops.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.fx as fx

from deepcompile_remat.config import RematConfig
from deepcompile_remat.fx_values import OP_NAMESPACE
from deepcompile_remat.zero3.grad_buckets import bucket_reduce_scatters
from deepcompile_remat.zero3.passes import (cast_before_gather, fold_reduce_casts,
                                            narrow_host_copies, price_regathers,
                                            read_secondary_in_backward,
                                            regather_within_secondary)
from deepcompile_remat.zero3.scratch import mark_scratch
from deepcompile_remat.zero3.scatter_overlap import scatter_backends, split_reduce_scatters
from deepcompile_remat.zero3.schedule import (ScheduleFigures, ScheduleOptions, schedule_gathers,
                                              use_async)
from deepcompile_remat.zero3.topology import Topology


def has_gathers(gm: fx.GraphModule) -> bool:
    """Whether `gm` has any of our (OP_NAMESPACE) ops."""
    return any(isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == OP_NAMESPACE
               for n in gm.graph.nodes)


class Zero3Runtime:
    """The ZeRO-3 passes (module docstring) for one config and one process-group layout."""

    def __init__(self, config: RematConfig, topology: Topology) -> None:
        self.config = config
        self.topology = topology
        self.settings = ScheduleOptions.from_config(config)

    def rewrite_joint(self, joint: fx.GraphModule, num_fwd_outputs: int) -> None:
        """Cast-before-gather on the joint graph, when configured and there are gathers (and
        host shards copied over in the gathered dtype); the re-gather prices; then the
        secondary shards of gathers whose shard group has a secondary group in the topology."""
        if not has_gathers(joint):
            return
        if self.config.cast_before_gather:
            cast_before_gather(joint)
            narrow_host_copies(joint)
        price_regathers(joint)
        regather_within_secondary(joint, num_fwd_outputs, self.topology.secondary_of)

    def rewrite(self, fw: fx.GraphModule, bw: fx.GraphModule, parameter_names: set[str],
                settings: ScheduleOptions) -> tuple[ScheduleFigures, ...]:
        """parameter_names: the primals that are parameters (shards): they live anyway, so the
        schedule's memory simulation counts them as persistent. Returns the figures of the
        forward and the backward, or () for graphs without our ops."""
        if not (has_gathers(fw) or has_gathers(bw)):
            return ()
        if settings.bucket_bytes is None or settings.grad_bucket_bytes is None:
            raise ValueError("deepcompile_remat: the bucket sizes are unresolved ('auto'): "
                             "the planning layer sets them from the graph before rewrite()")
        figures = {tag: ScheduleFigures(graph=tag) for tag in ("fw", "bw")}
        fold_reduce_casts(bw)  # before the schedule: the gradients wait in their own dtype
        for module in (fw, bw):  # what the collectives hold inside their call, for every
            mark_scratch(module)  # simulation from here on (priced again as nodes change)
        # Before the schedule: it moves and buckets the re-gathers this points at the slices.
        regathers, gathered, held, dropped = read_secondary_in_backward(bw)
        if self.config.schedule_gathers:
            for tag, module in (("fw", fw), ("bw", bw)):
                figures[tag] = schedule_gathers(module, settings, graph=tag,
                                                persistent_names=parameter_names)
        buckets = bucket_reduce_scatters(bw, settings.grad_bucket_bytes)
        mark_scratch(bw)  # the new buckets
        split, in_flight = 0, 0
        if use_async(scatter_backends(bw), settings.async_reduce_scatters):
            split, in_flight = split_reduce_scatters(bw, settings.prefetch_budget_bytes,
                                                     persistent_names=parameter_names)
        for module in (fw, bw):  # the final nodes (gather buckets, split collectives)
            mark_scratch(module)
        figures["bw"] = dataclasses.replace(
            figures["bw"], reduce_scatter_buckets=buckets, async_reduce_scatters=split,
            max_reduce_scatters_in_flight=in_flight, secondary_regathers=regathers,
            secondary_regather_bytes=gathered, secondary_shard_bytes=held,
            secondary_dropped=dropped)
        return tuple(dataclasses.replace(f, bucket_bytes=settings.bucket_bytes,
                                         grad_bucket_bytes=settings.grad_bucket_bytes)
                     for f in figures.values())


def summary_of(figures: Sequence[ScheduleFigures]) -> str:
    """'; N backward re-gathers ...' where the runtime re-gathered within secondary groups
    (zero3.shard(secondary_group=)), for the report's summary line; '' otherwise."""
    figs = [f for f in figures if f.secondary_regathers or f.secondary_dropped]
    if not figs:
        return ""
    dropped = sum(f.secondary_dropped for f in figs)
    return (f"; {sum(f.secondary_regathers for f in figs)} backward re-gathers "
            f"({sum(f.secondary_regather_bytes for f in figs)} bytes) within the secondary "
            f"group, from {sum(f.secondary_shard_bytes for f in figs)} bytes of secondary "
            "shards kept since the forward"
            + (f" ({dropped} not kept: the memory budget)" if dropped else ""))
