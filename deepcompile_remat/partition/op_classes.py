"""Which OpClass (csrc/graph/joint_graph.h) an FX node belongs to.

The fusible set is torch's own default op list (so "conservative" means what it means in
torch's partitioner); on top of it we split out views, casts, cheap reductions, gathers and
getitems, which the C++ cost model and the ZeRO-3 marking treat specially.
"""
from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx

from deepcompile_remat import _C
from deepcompile_remat.fx_arrays import OP_CLASS
from deepcompile_remat.fx_values import OP_NAMESPACE

aten = torch.ops.aten
prims = torch.ops.prims

OpClass = _C.OpClass  # defined once, in C++ (csrc/graph/joint_graph.h)


def _packets(namespace, *names: str) -> frozenset:
    """The op packets that exist in this torch build (2.11 and 2.13 differ slightly)."""
    return frozenset(getattr(namespace, n) for n in names if hasattr(namespace, n))


_CASTS = _packets(aten, "_to_copy", "to", "type_as", "_autocast_to_reduced_precision",
                  "_autocast_to_full_precision") | _packets(prims, "convert_element_type")
_REDUCTIONS = _packets(aten, "sum", "mean", "amax", "amin", "var", "std", "var_mean", "any",
                       "argmax", "max", "min", "_grad_sum_to_size", "sum_to_size") | _packets(
    prims, "var", "sum", "prepare_softmax_online")
_EXTRA_COMPUTE_INTENSIVE = _packets(
    aten, "baddbmm", "addbmm", "linear", "matmul", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_backward",
    "_efficient_attention_backward", "_scaled_dot_product_flash_attention_for_cpu_backward")
# Gathers that are not functional collectives: our own runtime ops (deepcompile_remat.zero3).
GATHER_NAMESPACES = {"_c10d_functional", "c10d_functional", OP_NAMESPACE}


@functools.lru_cache(maxsize=1)
def _torch_op_lists():
    from torch._functorch.partitioners import get_default_op_list

    ops = get_default_op_list()
    return (frozenset(ops.recomputable_ops), frozenset(ops.compute_intensive_ops) | _EXTRA_COMPUTE_INTENSIVE,
            frozenset(ops.random_ops), frozenset(ops.view_ops))


@functools.lru_cache(maxsize=1)
def _with_effects():
    try:
        from torch._higher_order_ops.effects import with_effects
    except ImportError:  # a torch without effect tokens
        return None
    return with_effects


def _no_dropout(node: fx.Node, target: torch._ops.OpOverload) -> bool:
    """An op tagged nondeterministic_seeded only for its dropout (the SDPA kernels) draws
    nothing when dropout_p is 0: run again, it gives the same result, so it is an ordinary
    compute-intensive op (torch's budget solver recomputes it too)."""
    for i, arg in enumerate(target._schema.arguments):
        if arg.name != "dropout_p":
            continue
        if i < len(node.args):
            value = node.args[i]
        elif arg.name in node.kwargs:
            value = node.kwargs[arg.name]
        elif arg.has_default_value():
            value = arg.default_value
        else:
            return False
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0
    return False


def draws_randomness(node: fx.Node) -> bool:
    """A seeded random op (Tag.nondeterministic_seeded) that draws in this call: running it
    again without its forward RNG state would give another result. SDPA with dropout_p == 0
    carries the tag but draws nothing."""
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and _is_seeded(target) and not _no_dropout(node, target))


def classify(node: fx.Node) -> OpClass:
    """The OpClass of `node` (module docstring); a class a runtime pass set on the node
    (fx_arrays.OP_CLASS) comes first."""
    if OP_CLASS in node.meta:
        return OpClass(node.meta[OP_CLASS])
    if node.op == "placeholder":
        return OpClass.PLACEHOLDER
    if node.op == "get_attr":
        return OpClass.VIEW  # a reference to a module constant: never saved, free to redo
    if node.op != "call_function":
        return OpClass.OTHER
    target = node.target
    if target is operator.getitem:
        return OpClass.GETITEM
    if target is _with_effects():
        # An effectful op (I/O, RNG state, a collective): like a random op, running it again
        # in the backward is not the same computation, so it is never recomputed.
        return OpClass.RANDOM
    if isinstance(target, torch._ops.OpOverload):
        draws = _is_seeded(target) and not _no_dropout(node, target)
        return _class_of_op(target, draws)
    if target in _torch_op_lists()[0]:  # SymInt arithmetic (operator.mul, sym_max, ...)
        return OpClass.POINTWISE
    return OpClass.OTHER


@functools.lru_cache(maxsize=None)
def _is_seeded(target: torch._ops.OpOverload) -> bool:
    return torch.Tag.nondeterministic_seeded in target.tags


@functools.lru_cache(maxsize=None)
def _class_of_op(target: torch._ops.OpOverload, draws: bool) -> OpClass:
    """The OpClass of an op, given whether this call draws randomness (draws_randomness): the
    one fact that depends on the node, so the rest is worked out once per op (a joint graph
    of 4k nodes has a few dozen ops)."""
    recomputable, compute_intensive, random, views = _torch_op_lists()
    if target.namespace in GATHER_NAMESPACES:
        return OpClass.GATHER
    packet = target.overloadpacket
    if packet in random or draws:
        return OpClass.RANDOM
    if packet in _CASTS:
        return OpClass.CAST
    if target.is_view or packet in views:
        return OpClass.VIEW
    if packet in compute_intensive:
        return OpClass.COMPUTE_INTENSIVE
    if packet in _REDUCTIONS:
        return OpClass.REDUCTION
    if packet in recomputable or torch.Tag.pointwise in target.tags:
        return OpClass.POINTWISE
    return OpClass.OTHER
