"""What the gather and reduce-scatter buckets share: greedy packing in graph order, and the
rewrite of a bucket's members into one collective whose items take their places."""
from __future__ import annotations

import operator
from typing import Callable

import torch.fx as fx


def pack_in_order(candidates: list, key_of: Callable, size_of: Callable, budget: float,
                  must_close: Callable[[list, fx.Node], bool]) -> list[list]:
    """Candidates (in graph order) packed greedily, per key, into buckets of at most `budget`
    bytes in all; must_close(members, node) closes the open bucket before `node` joins."""
    open_buckets: dict = {}
    closed = []
    for node in candidates:
        key = key_of(node)
        members = open_buckets.get(key, [])
        total = sum(size_of(m) for m in members) + size_of(node)
        if members and (total > budget or must_close(members, node)):
            closed.append(members)
            members = []
        members.append(node)
        open_buckets[key] = members
    return [m for m in closed + list(open_buckets.values()) if len(m) >= 2]


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
