"""The ZeRO-3 runtime's hooks into the partitioner: what it adds around the cut.

    partition_fn = remat_partition_fn(config, hooks=[Zero3Hooks(config)])  # backends.py

rewrite_joint runs on the joint graph before the cut (cast-before-gather, so the backward's
re-gathers are downcast too; node-local re-gathers from secondary shards, zero3/passes.py);
after_extract points the backward's remaining re-gathers at the secondary shards, reorders the
forward and backward graphs (the C++ re-gather schedule, buckets, async prefetch), buckets the backward's small gradient
reduce-scatters (zero3/grad_buckets.py), splits them into start/wait pairs that overlap the
rest of the backward (zero3/scatter_overlap.py) and returns its figures for the report (one
ScheduleFigures per graph). Both do nothing
on a graph without our ops. The partitioner itself knows nothing of ZeRO-3.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.fx as fx

from deepcompile_remat.config import RematConfig
from deepcompile_remat.fx_values import OP_NAMESPACE
from deepcompile_remat.zero3.grad_buckets import bucket_reduce_scatters
from deepcompile_remat.zero3 import custom_ops
from deepcompile_remat.zero3.passes import (cast_before_gather, price_regathers,
                                            read_secondary_in_backward,
                                            regather_within_secondary)
from deepcompile_remat.zero3.scatter_overlap import scatter_backends, split_reduce_scatters
from deepcompile_remat.zero3.schedule import (ScheduleFigures, ScheduleOptions, schedule_gathers,
                                              use_async)


def has_gathers(gm: fx.GraphModule) -> bool:
    """Whether `gm` has any of our (OP_NAMESPACE) ops."""
    return any(isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == OP_NAMESPACE
               for n in gm.graph.nodes)


class Zero3Hooks:
    """The ZeRO-3 runtime's PartitionHook (module docstring), configured by one RematConfig."""

    def __init__(self, config: RematConfig) -> None:
        self.config = config
        self.schedule_options = ScheduleOptions.from_config(config)

    def rewrite_joint(self, joint: fx.GraphModule, num_fwd_outputs: int) -> None:
        """Cast-before-gather on the joint graph, when configured and there are gathers; then
        the secondary shards of gathers whose shard group has a secondary group."""
        if not has_gathers(joint):
            return
        if self.config.cast_before_gather:
            cast_before_gather(joint)
        price_regathers(joint)
        regather_within_secondary(joint, num_fwd_outputs, _secondary_of)

    def after_extract(self, fw: fx.GraphModule, bw: fx.GraphModule,
                      parameter_names: set[str], *, bucket_bytes: Optional[float] = None
                      ) -> tuple[ScheduleFigures, ...]:
        """parameter_names: the primals that are parameters (shards): they live anyway, so the
        schedule's memory simulation counts them as persistent. bucket_bytes: buckets of
        this size instead of RematConfig.bucket_bytes (peak-target mode's search). Returns
        the figures of the forward and the backward, or () for graphs without our ops."""
        c = self.config
        options = self.schedule_options
        if bucket_bytes is not None:
            options = dataclasses.replace(options, bucket_bytes=float(bucket_bytes))
        if not (has_gathers(fw) or has_gathers(bw)):
            return ()
        figures = {tag: ScheduleFigures(graph=tag) for tag in ("fw", "bw")}
        # Before the schedule: it moves and buckets the re-gathers this points at the slices.
        regathers, gathered, held, dropped = read_secondary_in_backward(bw)
        if c.schedule_gathers:
            for tag, module in (("fw", fw), ("bw", bw)):
                figures[tag] = schedule_gathers(module, options, graph=tag,
                                                persistent_names=parameter_names)
        buckets = bucket_reduce_scatters(bw, options.bucket_bytes)
        split, in_flight = 0, 0
        if use_async(scatter_backends(bw), options.async_reduce_scatters):
            split, in_flight = split_reduce_scatters(bw, options.budget_bytes,
                                                     persistent_names=parameter_names)
        figures["bw"] = dataclasses.replace(
            figures["bw"], reduce_scatter_buckets=buckets, async_reduce_scatters=split,
            max_reduce_scatters_in_flight=in_flight, secondary_regathers=regathers,
            secondary_regather_bytes=gathered, secondary_shard_bytes=held,
            secondary_dropped=dropped)
        return tuple(figures.values())


def _secondary_of(group_name: str):
    """(k, name) of the secondary group recorded for shard group `group_name`, or None."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    secondary = custom_ops.secondary_group_of(custom_ops.resolve_group(group_name))
    if secondary is None:
        return None
    return dist.get_world_size(secondary), secondary.group_name
