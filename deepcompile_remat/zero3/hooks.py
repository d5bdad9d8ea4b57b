"""The ZeRO-3 runtime's hooks into the partitioner: what it adds around the cut.

    partition_fn = make_partition_fn(config, hooks=[Zero3Hooks(config)])

rewrite_joint runs on the joint graph before the cut (cast-before-gather, so the backward's
re-gathers are downcast too); after_extract reorders the forward and backward graphs (the C++
re-gather schedule, buckets, async prefetch), buckets the backward's small gradient
reduce-scatters (zero3/grad_buckets.py) and returns its figures for the report. Both do nothing
on a graph without our ops. The partitioner itself knows nothing of ZeRO-3.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from deepcompile_remat.config import RematConfig
from deepcompile_remat.zero3.grad_buckets import bucket_reduce_scatters
from deepcompile_remat.zero3.passes import cast_before_gather
from deepcompile_remat.zero3.schedule import schedule_gathers


def has_gathers(gm: fx.GraphModule) -> bool:
    return any(isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "dcr"
               for n in gm.graph.nodes)


class Zero3Hooks:
    def __init__(self, config: RematConfig) -> None:
        self.config = config

    def rewrite_joint(self, joint: fx.GraphModule) -> None:
        if self.config.cast_before_gather and has_gathers(joint):
            cast_before_gather(joint)

    def after_extract(self, fw: fx.GraphModule, bw: fx.GraphModule,
                      parameter_names: set[str]) -> tuple[dict, ...]:
        """parameter_names: the primals that are parameters (shards): they live anyway, so the
        schedule's memory simulation counts them as persistent."""
        c = self.config
        if not (has_gathers(fw) or has_gathers(bw)):
            return ()
        figures = {"fw": {"graph": "fw"}, "bw": {"graph": "bw"}}
        if c.schedule_gathers:
            for tag, module in (("fw", fw), ("bw", bw)):
                figures[tag].update(schedule_gathers(
                    module, persistent_names=parameter_names, max_prefetch=c.max_prefetch,
                    budget_bytes=c.prefetch_budget_bytes, bucket_bytes=c.bucket_bytes,
                    async_gathers=c.async_gathers))
        figures["bw"]["reduce_scatter_buckets"] = bucket_reduce_scatters(bw, c.bucket_bytes)
        return tuple(figures.values())
