"""Dead-code elimination of a joint graph, FX's rule at a lower cost.

The same nodes go as with ``fx.Graph.eliminate_dead_code``: in reverse order, every node
with no users that is not impure (FX's Node.is_impure, with FX's choice of whether unused
random ops count as impure: they do outside a compile, inside one inductor's fallback_random
decides), then the same in the GraphModules its get_attr nodes name. It skips FX's lint and
asks each OpOverload's purity once, not once per node. Cost: O(nodes + edges).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from deepcompile_remat.partition import extract_fast


def eliminate_dead_code(gm: fx.GraphModule) -> int:
    """Erases the dead nodes of gm.graph (and of its get_attr subgraphs) in place; returns
    how many were erased in gm.graph."""
    graph = gm.graph
    impure_random = extract_fast._dce_impure_random()
    takes_flag = extract_fast._is_impure_takes_flag()
    cache: dict = {}
    erased = 0
    for n in reversed(graph.nodes):
        if n.users or n.op in ("placeholder", "output"):
            continue
        if isinstance(n.target, torch._ops.OpOverload):
            impure = cache.get(n.target)
            if impure is None:
                impure = cache[n.target] = n.is_impure(impure_random) if takes_flag \
                    else n.is_impure()
        else:
            impure = n.is_impure(impure_random) if takes_flag else n.is_impure()
        if not impure:
            graph.erase_node(n)
            erased += 1
    subgraphs = {n.target for n in graph.find_nodes(op="get_attr")}
    for name, child in gm.named_children():
        if name in subgraphs and isinstance(child, fx.GraphModule):
            child.graph.eliminate_dead_code()
            child.recompile()
    return erased
