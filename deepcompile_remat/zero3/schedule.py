"""Applies the C++ re-gather schedule (csrc/schedule) to a forward or backward FX graph.

Gathers and the views/casts that only reshape them are moved to just before their first use,
then prefetched max_prefetch steps (or as far as a given byte budget allows, which reads this
rank's sizes: the planning layer then agrees the distances across ranks and passes them back
as prefetch_distances); the C++ schedule also decides which gathers share one bucketed collective
(dcr::allgather_cast_bucket): small gathers that land at one point, and small gathers left
alone packed in order within bucket_bytes. This module only
exports the graph (fx_arrays) and applies the result. Every rank computes the same order from
the same graph, so collectives line up.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np
import torch
import torch.fx as fx

from deepcompile_remat import _C
from deepcompile_remat.config import AsyncGathers, RematConfig
from deepcompile_remat.fx_arrays import (compatibility_keys, graph_arrays, memory_graph,
                                         priced_scratch)
from deepcompile_remat.fx_values import OPS, is_alias
from deepcompile_remat.zero3 import custom_ops
from deepcompile_remat.zero3.bucketing import members_by_bucket, replace_with_bucket
from deepcompile_remat.zero3.passes import gather_dtype, is_allgather_cast

@dataclass(frozen=True, slots=True)
class ScheduleOptions:
    """The runtime's settings, all from RematConfig (the one source of their defaults). The
    bucket sizes are None where the config says "auto": the planning layer reads them from the
    graph (unit_buckets.py) before the runtime's passes run."""
    max_prefetch: int         # RematConfig.max_prefetch
    prefetch_budget_bytes: float  # RematConfig.prefetch_budget_bytes
    bucket_bytes: Optional[float]  # RematConfig.bucket_bytes, for gathers
    async_gathers: AsyncGathers  # RematConfig.async_gathers
    async_reduce_scatters: AsyncGathers = "off"  # RematConfig.async_reduce_scatters
    grad_bucket_bytes: Optional[float] = None  # RematConfig.bucket_bytes, for reduce-scatters
    # (forward, backward) prefetch distances the ranks agreed on (planning/agreement.py): set,
    # they replace max_prefetch and the budget
    prefetch_distances: Optional[tuple[int, int]] = None

    @classmethod
    def from_config(cls, config: RematConfig) -> "ScheduleOptions":
        """The options `config` asks for."""
        size = None if config.bucket_bytes == "auto" else float(config.bucket_bytes)
        return cls(max_prefetch=config.max_prefetch,
                   prefetch_budget_bytes=float(config.prefetch_budget_bytes),
                   bucket_bytes=size, async_gathers=config.async_gathers,
                   async_reduce_scatters=config.async_reduce_scatters, grad_bucket_bytes=size)

    def with_bucket_bytes(self, gather_bytes: float, grad_bytes: float) -> "ScheduleOptions":
        """These options with both bucket sizes set."""
        return dataclasses.replace(self, bucket_bytes=float(gather_bytes),
                                   grad_bucket_bytes=float(grad_bytes))


@dataclass(frozen=True, slots=True)
class ScheduleFigures:
    """What the ZeRO-3 passes did to one graph (PartitionReport.schedule holds one per graph).
    Peaks are the memory simulator's (csrc/memsim), None where the graph was not scheduled."""
    graph: str                                  # "fw" or "bw"
    gathers: int = 0                            # parameter gathers in the graph
    prefetch_distance: int = 0                  # in compute steps
    peak_bytes: Optional[float] = None          # with the chosen prefetch distance
    peak_bytes_no_prefetch: Optional[float] = None
    peak_bytes_input_order: Optional[float] = None  # before scheduling
    buckets: int = 0                            # bucketed gathers (each replaced >= 2)
    async_prefetched: int = 0                   # gathers (and gather buckets) split into start/wait
    max_in_flight: int = 0                      # most gathers outstanding at once
    reduce_scatter_buckets: int = 0             # bucketed gradient reduce-scatters (bw only)
    async_reduce_scatters: int = 0              # reduce-scatters split into start/wait (bw only)
    max_reduce_scatters_in_flight: int = 0      # most reduce-scatters outstanding at once
    secondary_regathers: int = 0                # re-gathers from secondary shards (bw only),
    secondary_regather_bytes: int = 0           # the full weights they gather: bytes that
                                                # stay in the secondary group (the node)
    secondary_shard_bytes: int = 0              # the secondary shards the forward hands over
    secondary_dropped: int = 0                  # secondary shards a memory budget gave up
    bucket_bytes: float = 0.0                   # the gather bucket size used
    grad_bucket_bytes: float = 0.0              # the reduce-scatter bucket size used (bw)


def _is_reshape_or_cast(node: fx.Node) -> bool:
    if is_alias(node):
        return True
    return node.op == "call_function" and node.target in (
        torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)


def _feeders(nodes: list) -> set:
    """The copies, casts and views that only feed gathers, from graph inputs (under
    offload_param: a host shard's cast and its copy to the accelerator). They move with the
    gather they feed, so a prefetched gather brings its host-to-device copy along."""
    chain = set()
    for node in nodes:  # forward: made from graph inputs through copies only
        if _is_reshape_or_cast(node) and node.all_input_nodes and all(
                p.op in ("placeholder", "get_attr") or p in chain for p in node.all_input_nodes):
            chain.add(node)
    feeders = set()
    for node in reversed(nodes):  # backward: read by gathers (or feeders) only
        if node in chain and node.users and all(
                is_allgather_cast(u) or u in feeders for u in node.users):
            feeders.add(node)
    return feeders


def schedule_gathers(gm: fx.GraphModule, options: ScheduleOptions, *, graph: str,
                     persistent_names: Iterable[str] = ()) -> ScheduleFigures:
    """Reorders and buckets `gm` in place as the C++ schedule decides; returns its figures.
    graph: the figures' tag ("fw" / "bw"); persistent_names: inputs that live anyway."""
    exported = graph_arrays(gm)  # shared with memory_graph: one node -> id map
    memory = memory_graph(gm, persistent_names, graph=exported, workspace=priced_scratch(gm))
    nodes, ids = exported.nodes, exported.ids
    movable = np.zeros(len(nodes), dtype=np.uint8)
    is_gather = np.zeros(len(nodes), dtype=np.uint8)
    for node in _feeders(nodes):
        movable[ids[node]] = 1
    for i, node in enumerate(nodes):
        if is_allgather_cast(node):
            movable[i] = is_gather[i] = 1
        elif _is_reshape_or_cast(node) and node.all_input_nodes and all(
                movable[ids[p]] for p in node.all_input_nodes):
            movable[i] = 1
    if not is_gather.any():
        return ScheduleFigures(graph=graph)
    gather_ids = np.flatnonzero(is_gather)
    gather_key = np.full(len(nodes), -1, dtype=np.int64)
    gather_key[gather_ids] = compatibility_keys([_gather_key(nodes[i]) for i in gather_ids])
    input_order = np.flatnonzero(memory.is_input == 0).astype(np.int64)
    max_prefetch, budget = int(options.max_prefetch), float(options.prefetch_budget_bytes)
    if options.prefetch_distances is not None:  # without a budget the distance is max_prefetch
        max_prefetch, budget = options.prefetch_distances[graph == "bw"], -1.0
    s = _C.schedule_regathers(
        memory, input_order=input_order, movable=movable, is_gather=is_gather,
        gather_key=gather_key, max_prefetch=max_prefetch, prefetch_budget_bytes=budget,
        bucket_bytes=float(options.bucket_bytes))
    apply_order(gm, nodes, memory.is_input, s.order)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}  # after reordering
    for members in members_by_bucket(nodes, s.bucket_of):
        members.sort(key=position.__getitem__)  # the bucket goes where its first member is
        _replace_with_bucket(gm, members)
    backends = _gather_backends(gm)
    prefetched, in_flight = 0, 0
    if use_async(backends, options.async_gathers):
        prefetched = _split_prefetched(gm)
        in_flight = limit_in_flight(gm, _in_flight_limit(backends))
    gm.graph.lint()
    gm.recompile()
    return ScheduleFigures(
        graph=graph, gathers=int(is_gather.sum()), prefetch_distance=int(s.prefetch_distance),
        peak_bytes=float(s.peak_bytes), peak_bytes_no_prefetch=float(s.peak_bytes_no_prefetch),
        peak_bytes_input_order=float(s.peak_bytes_input_order), buckets=int(s.num_buckets),
        async_prefetched=prefetched, max_in_flight=in_flight)


def apply_order(gm: fx.GraphModule, nodes: list, is_input: np.ndarray, order) -> None:
    """Reorders `gm` in place: placeholders (is_input) stay first, then nodes[i] for i in
    `order` (every non-input node, a valid order), then the output."""
    anchor = [n for n, inp in zip(nodes, is_input) if inp][-1] if is_input.any() else None
    for i in order:
        node = nodes[i]
        if anchor is None:
            gm.graph.find_nodes(op="output")[0].prepend(node)  # first node: before output
            anchor = node
            continue
        anchor.append(node)
        anchor = node


def _gather_key(g: fx.Node) -> tuple:
    """What a bucket's members must share: the shard's device, world size and group. Not the
    dtypes: members that gather in different dtypes (bf16-cast weights beside the fp32 norm
    weights autocast keeps) share a byte buffer (item_dtypes), as FSDP2's all-gathers do, so
    a layer's gathers stay one collective. In this order: buckets at one point are numbered
    by its text."""
    shard, world_size, group_name = g.args[:3]
    return str(shard.meta["val"].device), world_size, group_name


def _item_dtypes(members: list) -> list:
    """Each member's gathered dtype: its cast target, else its shard's dtype."""
    return [gather_dtype(m) or m.args[0].meta["val"].dtype for m in members]


def _replace_with_bucket(gm: fx.GraphModule, members: list) -> None:
    """One dcr::allgather_cast_bucket where members[0] stands, its items in the members' place
    (the members share their _gather_key). One typed buffer when every member's shard and
    gathered dtypes are the first's; else a byte buffer, one item dtype per member."""
    first = members[0]
    shards = [m.args[0] for m in members]
    kwargs = custom_ops.bucket_kwargs([s.meta["val"].dtype for s in shards],
                                      _item_dtypes(members))
    replace_with_bucket(gm, members, first, OPS.allgather_cast_bucket.default,
                        (shards, first.args[1], first.args[2]), kwargs)


def _gather_backends(gm: fx.GraphModule) -> set:
    """The backends ("nccl", "gloo", ...) that run the graph's gathers: each group's backend
    for its shard's device (a group "cpu:gloo,cuda:nccl" gathers CUDA shards over NCCL)."""
    return collective_backends([(n.args[0][0] if _is_gather_bucket(n) else n.args[0], n.args[2])
                                for n in gm.graph.nodes
                                if is_allgather_cast(n) or _is_gather_bucket(n)])


def collective_backends(operands) -> set:
    """The backends of collectives given as (a tensor operand's node, group name) pairs: each
    group's backend for the operand's device; "unknown" for a group this process lacks."""
    from deepcompile_remat.comm.collectives import backend_name
    from deepcompile_remat.zero3.custom_ops import resolve_group

    found = set()
    for operand, group_name in operands:
        device = operand.meta["val"].device.type
        try:
            found.add(backend_name(resolve_group(group_name), device))
        except (RuntimeError, ValueError):  # no such group in this process
            found.add("unknown")
    return found


def use_async(backends: set, setting: str) -> bool:
    """Whether collectives run by `backends` are split into start/wait under `setting`
    (RematConfig.async_gathers / async_reduce_scatters): "auto" means only when every one's
    group runs NCCL (see RematConfig)."""
    if setting != "auto":
        return setting == "on"
    return backends == {"nccl"}


def _in_flight_limit(backends: set):
    """How many gathers may be outstanding at once. NCCL: no limit beyond the schedule's memory
    budget. Anything else (gloo): one, as a precaution. It dates from when gathers were torch's
    functional collectives, which corrupt the heap on gloo with two or more in flight
    (scripts/repro_gloo_functional_collectives.py); the runtime now gathers through the plain
    API (collectives.gather_slots: all_gather_into_tensor / all_gather_single, async_op=True),
    which ran clean in that repro's "plain" mode. The limit stays: on CPU there is no compute
    stream for more gathers in flight to overlap with."""
    return None if backends <= {"nccl"} else 1


def _split_prefetched(gm: fx.GraphModule) -> int:
    """A gather the schedule moved ahead of its first use becomes dcr::allgather_cast_start
    where it stands and dcr::allgather_cast_wait just before its first use: the same fused
    cast-into-slot + in-place gather, issued early, so the communication overlaps the compute
    in between. A bucket (dcr::allgather_cast_bucket) likewise becomes
    dcr::allgather_cast_bucket_start / _wait, the wait (which copies the parameters out)
    before the first use of any of its items, the items after it."""
    dcr = OPS
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    split = 0
    for gather in [n for n in gm.graph.nodes if is_allgather_cast(n) or _is_gather_bucket(n)]:
        bucket = _is_gather_bucket(gather)
        items = list(gather.users) if bucket else []
        readers = [u for i in items for u in i.users] if bucket else list(gather.users)
        if not readers:
            continue
        first_use = min(readers, key=position.__getitem__)
        between = position[first_use] - position[gather] - 1
        if between <= sum(position[i] < position[first_use] for i in items):
            continue  # used right away: nothing to overlap
        if bucket:
            shards, world_size, group_name = gather.args[:3]
            item_dtypes = gather.kwargs.get("item_dtypes")
            with gm.graph.inserting_before(gather):
                start = gm.graph.call_function(dcr.allgather_cast_bucket_start.default,
                                               gather.args, gather.kwargs)
                start.meta["val"] = _packed_val(gather)
            with gm.graph.inserting_before(first_use):
                wait = gm.graph.call_function(
                    dcr.allgather_cast_bucket_wait.default,
                    (start, [s.meta["val"].numel() for s in shards]),
                    {"item_dtypes": item_dtypes} if item_dtypes is not None else {})
                wait.meta["val"] = gather.meta["val"]
            gather.replace_all_uses_with(wait)
            for item in sorted(items, key=position.__getitem__):
                first_use.prepend(item)  # after the wait, in their order
        else:
            with gm.graph.inserting_before(gather):
                start = gm.graph.call_function(dcr.allgather_cast_start.default, gather.args,
                                               gather.kwargs)
                start.meta["val"] = gather.meta["val"]
            with gm.graph.inserting_before(first_use):
                gm.graph.call_function(dcr.allgather_cast_wait.default, (start,))
            gather.replace_all_uses_with(start)
        gm.graph.erase_node(gather)
        split += 1
    return split


def _packed_val(bucket: fx.Node):
    """The packed buffer (a fake tensor) of a dcr::allgather_cast_bucket node."""
    shards = [s.meta["val"] for s in bucket.args[0]]
    dtype, numel = custom_ops.bucket_buffer(shards, bucket.args[1], bucket.kwargs.get("dtype"),
                                            bucket.kwargs.get("item_dtypes"))
    return shards[0].new_empty(numel, dtype=dtype)


def _is_gather_bucket(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is OPS.allgather_cast_bucket.default


def _is_start(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (
        OPS.allgather_cast_start.default, OPS.allgather_cast_bucket_start.default)


def _is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (
        OPS.allgather_cast_wait.default, OPS.allgather_cast_bucket_wait.default)


def limit_in_flight(gm: fx.GraphModule, limit=None) -> int:
    """Moves waits earlier so that at most `limit` gather starts are outstanding at any point
    (None: no limit); the oldest outstanding gather is waited on first. Moving a wait earlier
    is always legal: its only input is its start. Returns the most starts outstanding at once
    in the resulting order."""
    if limit is not None and limit < 1:
        raise ValueError(f"in-flight limit must be at least 1, got {limit}")
    outstanding: list = []  # starts issued and not yet waited on, oldest first
    most = 0
    for node in list(gm.graph.nodes):
        if _is_wait(node):
            start = node.args[0]
            if start in outstanding:
                outstanding.remove(start)
            continue
        if not _is_start(node):
            continue
        while limit is not None and len(outstanding) >= limit:
            oldest = outstanding.pop(0)
            for w in [u for u in oldest.users if _is_wait(u)]:
                node.prepend(w)
        outstanding.append(node)
        most = max(most, len(outstanding))
    return most
