"""Dead-code elimination of a joint graph: FX's rule at a lower cost.

The same nodes go as with ``fx.Graph.eliminate_dead_code``: in reverse order, every node
with no users that is not impure (FX's Node.is_impure, with FX's choice of whether unused
random ops count as impure: they do outside a compile, inside one inductor's fallback_random
decides), then the same in the GraphModules its get_attr nodes name. It skips FX's lint and
asks each OpOverload's purity once, not once per node. Cost: O(nodes + edges).
"""
from __future__ import annotations

import functools
import inspect

import torch
import torch.fx as fx


def unused_random_ops_are_impure() -> bool:
    """Whether FX's dead-code elimination keeps unused random ops right now: it does
    outside a compile; inside one, inductor's fallback_random decides."""
    if torch._guards.TracingContext.try_get():
        return bool(torch._inductor.config.fallback_random)
    return True


@functools.lru_cache(maxsize=1)
def _is_impure_takes_flag() -> bool:
    return "impure_random" in inspect.signature(fx.Node.is_impure).parameters


class ImpureNodes:
    """FX's purity test with one answer per OpOverload (theirs depends on the op alone)."""

    def __init__(self):
        self._impure_random = unused_random_ops_are_impure()
        self._takes_flag = _is_impure_takes_flag()
        self._by_op: dict = {}

    def _ask(self, node: fx.Node) -> bool:
        return node.is_impure(self._impure_random) if self._takes_flag else node.is_impure()

    def __call__(self, node: fx.Node) -> bool:
        """Whether dead-code elimination must keep `node` although nothing reads it."""
        if isinstance(node.target, torch._ops.OpOverload):
            impure = self._by_op.get(node.target)
            if impure is None:
                impure = self._by_op[node.target] = self._ask(node)
            return impure
        return self._ask(node)


def eliminate_dead_code(gm: fx.GraphModule) -> int:
    """Erases the dead nodes of gm.graph (and of its get_attr subgraphs) in place; returns
    how many were erased in gm.graph."""
    graph = gm.graph
    impure = ImpureNodes()
    erased = 0
    for n in reversed(graph.nodes):
        if n.users or n.op in ("placeholder", "output") or impure(n):
            continue
        graph.erase_node(n)
        erased += 1
    subgraphs = {n.target for n in graph.find_nodes(op="get_attr")}
    for name, child in gm.named_children():
        if name in subgraphs and isinstance(child, fx.GraphModule):
            child.graph.eliminate_dead_code()
            child.recompile()
    return erased
