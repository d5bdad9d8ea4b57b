"""Applies buckets decided in C++ (csrc/schedule/buckets.h: the one bucketing rule, for gathers
and reduce-scatters alike): groups a bucket's members, and rewrites them into one collective
whose items take their places. No packing rule lives here."""
from __future__ import annotations

import operator
from typing import Sequence

import numpy as np
import torch.fx as fx


def members_by_bucket(nodes: Sequence[fx.Node], bucket_of: np.ndarray) -> list[list[fx.Node]]:
    """The members of each bucket (bucket_of[i] is nodes[i]'s bucket id, -1: alone), buckets in
    id order, members in the order of `nodes`."""
    buckets: dict[int, list] = {}
    for i in np.flatnonzero(np.asarray(bucket_of) >= 0):
        buckets.setdefault(int(bucket_of[i]), []).append(nodes[i])
    return [buckets[b] for b in sorted(buckets)]


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
