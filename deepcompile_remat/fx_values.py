"""Facts about FX nodes that the partitioner and the ZeRO-3 passes both need, in one neutral
place: what a value costs in bytes, whether a node only aliases (views) its input (and which
node's storage it shares), and which namespace our own ops live in (OP_NAMESPACE).

Symbolic sizes are costed by their hints (fallback 4096 elements, as torch's partitioner does)
in a single process. Under a process group of several ranks they are costed rank-independently
instead (every free symbol = 4096): each rank's hints are the sizes it happened to see first,
and ranks that cost one symbolic graph differently cut it differently, re-gather different
weights and hang in mismatched collectives. That cost decides; it is not what a report shows:
observed_bytes is the size at this process's hints (the sizes it compiled the graph for) and
symbolic_bytes the formula.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

SYMBOL_SIZE_WITHOUT_HINT = 4096

OP_NAMESPACE = "dcr"
"""The torch.library namespace of deepcompile_remat's custom ops (zero3/custom_ops.py registers
them as "dcr::<name>"); the ZeRO-3 passes find their ops by it and the partitioner counts them
as collectives. Written here once: every other module reads it or OPS."""
OPS = getattr(torch.ops, OP_NAMESPACE)
"""torch.ops.dcr: OPS.<name>.default is an op's overload (looked up when first asked for, so
this works before zero3/custom_ops.py registers the ops)."""


def _several_ranks() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank_independent_size(x) -> int:
    """x with every free symbol replaced by SYMBOL_SIZE_WITHOUT_HINT: a function of the
    symbolic graph alone, the same on every rank."""
    import sympy

    expr = x.node.expr
    try:
        value = expr.xreplace({s: sympy.Integer(SYMBOL_SIZE_WITHOUT_HINT)
                               for s in expr.free_symbols})
        return max(int(value), 0)
    except (TypeError, ValueError):  # an expression sympy cannot fold to a number
        return SYMBOL_SIZE_WITHOUT_HINT


def _hint(x, rank_independent: bool) -> int:
    if isinstance(x, int):
        return x
    if rank_independent:
        return _rank_independent_size(x)
    from torch.fx.experimental import symbolic_shapes as ss

    # optimization_hint (2.13) / hint_int (2.11): a size hint that adds no guard.
    hint = getattr(ss, "optimization_hint", None) or ss.hint_int
    return int(hint(x, fallback=SYMBOL_SIZE_WITHOUT_HINT))


def _bytes(val, rank_independent: bool) -> int:
    if isinstance(val, torch.Tensor):
        return _hint(val.numel(), rank_independent) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_bytes(v, rank_independent) for v in val)
    return 0


def value_bytes(val) -> float:
    """Bytes a saved value costs in the cut (tensors by their numel; 0 for non-tensors):
    rank-independent under several ranks (module docstring)."""
    return float(_bytes(val, _several_ranks()))


def observed_bytes(val) -> int:
    """Bytes of a value at the sizes this process compiled its graph for (its size hints)."""
    return _bytes(val, False)


def symbolic_bytes(val) -> str | None:
    """The byte size of a tensor with symbolic sizes as a formula of its size symbols ("8*s0");
    None where the size is static."""
    if not isinstance(val, torch.Tensor):
        return None
    numel = val.numel()
    if isinstance(numel, int):
        return None
    return str(numel.node.expr * val.element_size())


def is_view(node: fx.Node) -> bool:
    """An ATen view op: its output aliases its first input's storage."""
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and node.target.is_view)


def is_alias(node: fx.Node) -> bool:
    """A view, or a getitem (an element of a tuple output): no storage of its own."""
    return node.op == "call_function" and (node.target is operator.getitem or is_view(node))


def storage_root(node: fx.Node) -> fx.Node:
    """The node whose storage `node` shares: up through aliases (is_alias: views and getitems)
    while each one's first argument is a node; `node` itself when it has storage of its own."""
    while is_alias(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node
