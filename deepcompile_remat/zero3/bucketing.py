"""What the gather and reduce-scatter buckets share: greedy packing in graph order, and the
rewrite of a bucket's members into one collective whose items take their places."""
from __future__ import annotations

import operator
from typing import Callable

import torch.fx as fx


def pack_in_order(candidates: list, key_of: Callable, size_of: Callable, budget: float,
                  must_close: Callable[[list, fx.Node], bool]) -> list[list]:
    """Candidates (in graph order) of at most `budget` bytes each packed greedily, per key, into
    buckets of at most `budget` bytes in all; must_close(members, node) closes the open bucket
    before `node` joins. Larger candidates, and every candidate when budget <= 0, are left out."""
    if budget <= 0:
        return []
    open_buckets: dict = {}  # key -> (members, their bytes)
    closed = []
    for node in candidates:
        size = size_of(node)
        if size > budget:
            continue
        key = key_of(node)
        members, total = open_buckets.get(key, ([], 0.0))
        if members and (total + size > budget or must_close(members, node)):
            closed.append(members)
            members, total = [], 0.0
        members.append(node)
        open_buckets[key] = (members, total + size)
    buckets = closed + [members for members, _ in open_buckets.values()]
    return [m for m in buckets if len(m) >= 2]


def replace_with_bucket(gm: fx.GraphModule, members: list, anchor: fx.Node, target,
                        args: tuple, kwargs: dict) -> None:
    """One `target` node before `anchor`; its k-th item replaces members[k]."""
    with gm.graph.inserting_before(anchor):
        bucket = gm.graph.call_function(target, args, kwargs)
        bucket.meta["val"] = [m.meta["val"] for m in members]
        items = [gm.graph.call_function(operator.getitem, (bucket, k))
                 for k in range(len(members))]
    for item, m in zip(items, members):  # erase only after inserting: the anchor is a member
        item.meta["val"] = m.meta["val"]
        m.replace_all_uses_with(item)
        gm.graph.erase_node(m)
