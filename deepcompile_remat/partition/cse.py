"""Common-subexpression elimination of a joint graph, in place, in one pass.

torch's fx_graph_cse copies every node into a new graph; this pass erases only the
duplicates. Its rules are torch's, plus one:
  - two call_function nodes are the same value when their target, args and kwargs are equal
    (nested containers compared by structure, SymInt arguments by their SymNode, a leaf also
    by its type: 1 and 1.0 differ);
  - never merged: placeholders, get_attr and output; random ops (torch's rand_ops list, and
    any op tagged nondeterministic_seeded: two draws are not one value); effectful ops;
    aten.empty (its contents are undefined); nodes whose value shares storage with a graph
    output (distinct outputs must stay distinct objects); nodes whose value is an unbacked
    symbol;
  - a duplicate merges only within its mutation region (the span between two mutating ops):
    across a mutation the same expression may read other data, so the later one becomes the
    representative for what follows;
  - ours only: nodes merge only when their checkpoint tags agree (meta 'recompute' and
    'ac_graph_id'). Merging the same mask computed in two checkpoint regions would make one
    region's value an input of the other, which the cut must then save or recompute across
    the boundary (seen: more saved bytes than torch's on a checkpointed SDPA stack).
The first node of a class stays, with its meta. torch keys its table by a Python hash and,
where two different expressions collide (hash(-1) == hash(-2): unsqueeze(x, -1) after
unsqueeze(x, -2)), leaves the later one unmerged for good; this table is keyed by the
expression itself, so exact duplicates always merge (within the rules above).

Sets node.meta["mutation_region_id"] on every node, as torch's does (inductor reads it).
Cost: O(nodes + edges), each node hashed once; erasing a duplicate is O(its users).
"""
from __future__ import annotations

import functools
from typing import Any

import sympy
import torch
import torch.fx as fx

aten = torch.ops.aten
_SYM_TYPES = (torch.SymInt, torch.SymBool, torch.SymFloat)
# argument types keyed as (type, value) without further tests (the common case, first)
_PLAIN_LEAVES = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device,
                           torch.layout, torch.memory_format})


@functools.lru_cache(maxsize=1)
def _random_packets() -> frozenset:
    try:
        from torch._functorch.compile_utils import rand_ops
    except ImportError:
        rand_ops = []
    return frozenset(rand_ops)


@functools.lru_cache(maxsize=None)
def _never_merged(target) -> bool:
    """Random, effectful, or aten.empty: each call is its own value."""
    if isinstance(target, torch._ops.OpOverload):
        if target.overloadpacket in _random_packets() or target.overloadpacket is aten.empty:
            return True
        if torch.Tag.nondeterministic_seeded in target.tags:
            return True
    try:
        from torch._higher_order_ops.effects import _get_effect
    except ImportError:
        return False
    try:
        return _get_effect(target) is not None
    except Exception:  # an unusual target: be safe, never merge it
        return True


@functools.lru_cache(maxsize=None)
def _mutates_by_target(target) -> bool | None:
    """Whether an OpOverload mutates; None where torch's test also looks at the node."""
    from torch._inductor.pattern_matcher import fixme_incorrect_inductor_schema_op

    if fixme_incorrect_inductor_schema_op(target):
        return None
    return target._schema.is_mutable


def _is_mutation(node: fx.Node) -> bool:
    """torch's mutation test (pattern_matcher.is_mutation_op), cached per OpOverload."""
    if isinstance(node.target, torch._ops.OpOverload):
        mutates = _mutates_by_target(node.target)
        if mutates is not None:
            return mutates
    from torch._inductor.pattern_matcher import is_mutation_op

    return is_mutation_op(node)


def _key(arg: Any) -> Any:
    """A hashable key equal for equal arguments: containers by type and structure, a leaf
    with its type, a SymInt by its SymNode."""
    kind = type(arg)
    if kind is fx.Node:
        return arg
    if kind in _PLAIN_LEAVES:
        return (kind, arg)
    if kind is tuple or kind is list:
        return (kind, tuple(map(_key, arg)))
    if isinstance(arg, fx.Node):
        return arg
    if isinstance(arg, (tuple, list)):
        return (type(arg), tuple(_key(a) for a in arg))
    if isinstance(arg, dict):
        return (type(arg), tuple((k, _key(v)) for k, v in arg.items()))
    if isinstance(arg, _SYM_TYPES):
        return (type(arg), arg.node)
    return (type(arg), arg)


def _storage_id(val) -> int | None:
    """The storage of a tensor value, where it has one (fake tensors do)."""
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return val.untyped_storage()._cdata
    except NotImplementedError:
        return None


def _is_unbacked_symbol(val) -> bool:
    if not isinstance(val, sympy.Symbol):
        return False
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return bool(free_unbacked_symbols(val))


def eliminate_common_subexpressions(graph: fx.Graph) -> int:
    """Merges duplicate nodes of `graph` in place (rules in the module docstring); returns
    how many nodes were erased."""
    output = graph.find_nodes(op="output")[0]
    output_storages = {s for s in (_storage_id(n.meta.get("val")) for n in output.all_input_nodes)
                       if s is not None}
    alias_cache: dict[fx.Node, bool] = {}

    def aliases_output(n: fx.Node) -> bool:
        if n not in alias_cache:
            alias_cache[n] = _storage_id(n.meta.get("val")) in output_storages
        return alias_cache[n]

    table: dict[Any, fx.Node] = {}
    region = 0
    erased = 0
    for n in list(graph.nodes):
        if _is_mutation(n):
            region += 1
        n.meta["mutation_region_id"] = region
        if n.op != "call_function" or _never_merged(n.target):
            continue
        if _is_unbacked_symbol(n.meta.get("val")):
            continue
        try:
            key = (n.target, _key(n.args), _key(n.kwargs), n.meta.get("recompute"),
                   n.meta.get("ac_graph_id"))
            hash(key)
        except TypeError:  # an unhashable constant argument: leave the node alone
            continue
        rep = table.get(key)
        if rep is None:
            table[key] = n  # output aliasing is checked only on a hit (rarely needed)
            continue
        if aliases_output(n):
            continue  # kept, and never a representative
        if aliases_output(rep):
            table[key] = n  # rep was never a representative: n is the first that can be
            continue
        if rep.meta["mutation_region_id"] != region:
            table[key] = n  # a mutation lies between: n represents what follows it
            continue
        n.replace_all_uses_with(rep)
        graph.erase_node(n)
        erased += 1
    return erased
