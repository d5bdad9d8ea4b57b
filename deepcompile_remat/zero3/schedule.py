"""Applies the C++ re-gather schedule (csrc/schedule) to a forward or backward FX graph.

Gathers and the views/casts that only reshape them are moved to just before their first use,
then prefetched as far as the memory budget allows; small gathers that land at one point
become one bucketed collective (dcr::allgather_cast_bucket), and small gathers left alone are
packed, in order, into buckets of at most bucket_bytes. Every rank computes the same order
from the same graph, so collectives line up.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np
import torch
import torch.fx as fx

from deepcompile_remat import _C
from deepcompile_remat.fx_values import is_alias, value_bytes
from deepcompile_remat.zero3.bucketing import pack_in_order, replace_with_bucket
from deepcompile_remat.zero3.passes import gather_dtype, is_allgather_cast


def _is_reshape_or_cast(node: fx.Node) -> bool:
    if is_alias(node):
        return True
    return node.op == "call_function" and node.target in (
        torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)


def memory_arrays(gm: fx.GraphModule, persistent_names: Iterable[str] = ()):
    """The graph as memsim arrays: (nodes, bytes, alias_of, is_input, persistent, keep, tails, heads)."""
    persistent_names = set(persistent_names)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    ids = {n: i for i, n in enumerate(nodes)}
    n = len(nodes)
    nbytes = np.zeros(n)
    alias_of = np.full(n, -1, dtype=np.int64)
    is_input = np.zeros(n, dtype=np.uint8)
    persistent = np.zeros(n, dtype=np.uint8)
    keep = np.zeros(n, dtype=np.uint8)
    tails, heads = [], []
    for i, node in enumerate(nodes):
        is_input[i] = node.op in ("placeholder", "get_attr")
        persistent[i] = node.op == "get_attr" or node.name in persistent_names
        if is_alias(node) and isinstance(node.args[0], fx.Node):
            alias_of[i] = ids[node.args[0]]
        else:
            nbytes[i] = value_bytes(node.meta.get("val"))
        for p in dict.fromkeys(node.all_input_nodes):
            tails.append(ids[p])
            heads.append(i)
    out = gm.graph.find_nodes(op="output")[0]
    for x in out.all_input_nodes:
        keep[ids[x]] = 1
    return (nodes, nbytes, alias_of, is_input, persistent, keep,
            np.asarray(tails, dtype=np.int64), np.asarray(heads, dtype=np.int64))


def schedule_gathers(gm: fx.GraphModule, *, persistent_names: Iterable[str] = (),
                     max_prefetch: int = 2, budget_bytes: float = -1.0,
                     bucket_bytes: float = 0.0, async_gathers: str = "auto") -> dict:
    """Reorders `gm` in place; returns the schedule's figures (simulated peaks, distance, buckets)."""
    nodes, nbytes, alias_of, is_input, persistent, keep, tails, heads = memory_arrays(
        gm, persistent_names)
    ids = {n: i for i, n in enumerate(nodes)}
    movable = np.zeros(len(nodes), dtype=np.uint8)
    is_gather = np.zeros(len(nodes), dtype=np.uint8)
    for i, node in enumerate(nodes):
        if is_allgather_cast(node):
            movable[i] = is_gather[i] = 1
        elif _is_reshape_or_cast(node) and node.all_input_nodes and all(
                movable[ids[p]] for p in node.all_input_nodes):
            movable[i] = 1
    if not is_gather.any():
        return {"gathers": 0}
    input_order = np.asarray([i for i in range(len(nodes)) if not is_input[i]], dtype=np.int64)
    s = _C.schedule_regathers(nbytes, alias_of, is_input, persistent, keep, tails, heads,
                              input_order, movable, is_gather, int(max_prefetch),
                              float(budget_bytes), float(bucket_bytes))
    # Placeholders stay first; everything else follows the schedule.
    anchor = [n for n in nodes if is_input[ids[n]]][-1] if is_input.any() else None
    for i in s["order"]:
        node = nodes[i]
        if anchor is None:
            gm.graph.find_nodes(op="output")[0].prepend(node)  # first node: before output
            anchor = node
            continue
        anchor.append(node)
        anchor = node
    buckets = _bucket(gm, nodes, s["bucket_of"]) + _bucket_small_gathers(gm, bucket_bytes)
    backends = _gather_backends(gm)
    prefetched, in_flight = 0, 0
    if _use_async(backends, async_gathers):
        prefetched = _split_prefetched(gm)
        in_flight = limit_in_flight(gm, _in_flight_limit(backends))
    gm.graph.lint()
    gm.recompile()
    return {"gathers": int(is_gather.sum()), "prefetch_distance": int(s["prefetch_distance"]),
            "peak_bytes": float(s["peak_bytes"]),
            "peak_bytes_no_prefetch": float(s["peak_bytes_no_prefetch"]),
            "peak_bytes_input_order": float(s["peak_bytes_input_order"]),
            "buckets": buckets, "async_prefetched": prefetched, "max_in_flight": in_flight}


def _bucket(gm: fx.GraphModule, nodes: list, bucket_of: np.ndarray) -> int:
    """Replaces each bucket of >= 2 compatible gathers by one dcr::allgather_cast_bucket."""
    groups: dict = {}
    for i in np.flatnonzero(bucket_of >= 0):
        g = nodes[i]
        groups.setdefault((int(bucket_of[i]), *_gather_key(g)), []).append(g)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}  # after reordering
    made = 0
    for _, members in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][3:]))):
        if len(members) < 2:
            continue
        members.sort(key=position.__getitem__)  # the bucket goes where its first member was
        _replace_with_bucket(gm, members)
        made += 1
    return made


def _gather_key(g: fx.Node) -> tuple:
    """What a bucket's members must share: world size, group and target dtype, and also the
    shard's dtype and device (one buffer per bucket: a bf16 and an fp32 shard in one buffer
    would be promoted silently)."""
    shard, world_size, group_name = g.args[:3]
    val = shard.meta["val"]
    return world_size, group_name, gather_dtype(g), val.dtype, str(val.device)


def _replace_with_bucket(gm: fx.GraphModule, members: list) -> None:
    """One dcr::allgather_cast_bucket where members[0] stands, its items in the members' place
    (the members share their _gather_key)."""
    first = members[0]
    replace_with_bucket(gm, members, first, torch.ops.dcr.allgather_cast_bucket.default,
                        ([m.args[0] for m in members], first.args[1], first.args[2]),
                        {"dtype": gather_dtype(first)})


def _bucket_small_gathers(gm: fx.GraphModule, bucket_bytes: float) -> int:
    """Small gathers still alone after the schedule (a layer norm's weight, a bias: each at its
    own first use) are packed, in graph order, into buckets of at most `bucket_bytes` in all,
    each issued where its first member stood. A gather is a fixed latency whatever its size,
    and a member gathered early holds at most `bucket_bytes` longer than it had to."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}

    def full_bytes(node):
        return value_bytes(node.meta.get("val"))

    def shard_too_late(members, node):  # the bucket stands where its first member stands
        return position[node.args[0]] > position[members[0]]

    buckets = pack_in_order([n for n in gm.graph.nodes if is_allgather_cast(n)],
                            _gather_key, full_bytes, bucket_bytes, shard_too_late)
    for members in buckets:
        _replace_with_bucket(gm, members)
    return len(buckets)


def _gather_backends(gm: fx.GraphModule) -> set:
    """The backends ("nccl", "gloo", ...) that run the graph's gathers: each group's backend
    for its shard's device (a group "cpu:gloo,cuda:nccl" gathers CUDA shards over NCCL)."""
    from deepcompile_remat.comm.collectives import backend_name
    from deepcompile_remat.zero3.custom_ops import resolve_group

    found = set()
    for n in gm.graph.nodes:
        if not is_allgather_cast(n):
            continue
        device = n.args[0].meta["val"].device.type
        try:
            found.add(backend_name(resolve_group(n.args[2]), device))
        except (RuntimeError, ValueError):  # no such group in this process
            found.add("unknown")
    return found


def _use_async(backends: set, async_gathers: str) -> bool:
    """"auto": async start/wait only when every gather's group runs NCCL (see RematConfig)."""
    if async_gathers != "auto":
        return async_gathers == "on"
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
    in between."""
    dcr = torch.ops.dcr
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    split = 0
    for gather in [n for n in gm.graph.nodes if is_allgather_cast(n)]:
        if not gather.users:
            continue
        first_use = min(gather.users, key=position.__getitem__)
        if position[first_use] == position[gather] + 1:
            continue  # used right away: nothing to overlap
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


def _is_start(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.dcr.allgather_cast_start.default


def _is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.dcr.allgather_cast_wait.default


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
