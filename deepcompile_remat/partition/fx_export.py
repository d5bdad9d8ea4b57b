"""What each node of an AOTAutograd joint graph is for the cut: its op class, flags (_C.NodeFlag)
and checkpoint tag. The arrays themselves are built by deepcompile_remat.fx_arrays, the one
bridge from FX to the C++ core (node ids are FX order, a topological order; sizes come from
``meta["val"]`` through ``fx_values.value_bytes``).
"""
from __future__ import annotations

import functools
from typing import Iterable, Optional, Sequence

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from deepcompile_remat import _C, fx_arrays
from deepcompile_remat.fx_arrays import (COPIED_WHEN_SAVED, PIN_TO_FORWARD, ExportedJointGraph,
                                         NodeFacts)
from deepcompile_remat.fx_values import value_bytes
from deepcompile_remat.partition import extract
from deepcompile_remat.partition.op_classes import OpClass, classify, draws_randomness

NodeFlag = _C.NodeFlag
_TAGS = {  # CheckpointPolicy -> the C++ tag, as the int the arrays hold
    CheckpointPolicy.MUST_SAVE: int(_C.RecomputeTag.MUST_SAVE),
    CheckpointPolicy.PREFER_SAVE: int(_C.RecomputeTag.PREFER_SAVE),
    CheckpointPolicy.MUST_RECOMPUTE: int(_C.RecomputeTag.MUST_RECOMPUTE),
    CheckpointPolicy.PREFER_RECOMPUTE: int(_C.RecomputeTag.PREFER_RECOMPUTE),
}
_NO_TAG = int(_C.RecomputeTag.NONE)
_CLASS_IDS = {c: int(c) for c in OpClass.__members__.values()}  # int() of a bound enum is slow
_SYMINT_BYTES = 8


def is_tangent(n: fx.Node) -> bool:
    """True for a joint-graph input that is an incoming gradient (AOTAutograd's tangents_*)."""
    return n.op == "placeholder" and "tangents" in str(n.target)


def is_fwd_seed(n: fx.Node) -> bool:
    """True for the forward's RNG seed or offset input (functionalized randomness)."""
    t = str(n.target)
    return n.op == "placeholder" and ("fwd_seed" in t or "fwd_base_offset" in t)


def is_bwd_seed(n: fx.Node) -> bool:
    """True for the backward's RNG seed or offset input (functionalized randomness)."""
    t = str(n.target)
    return n.op == "placeholder" and ("bwd_seed" in t or "bwd_base_offset" in t)


def is_primal(n: fx.Node) -> bool:
    """True for a forward input of the joint graph: a placeholder that is neither a tangent nor
    an RNG seed."""
    return n.op == "placeholder" and not (is_tangent(n) or is_fwd_seed(n) or is_bwd_seed(n))


@functools.lru_cache(maxsize=1)
def _torch_must_be_in_backward():
    try:  # torch's own rule (partitioner tags, mutations in backward); absent in old builds
        from torch._functorch.partitioners import _must_be_in_backward as torch_rule
    except ImportError:
        return None
    return torch_rule


def _must_be_in_backward(n: fx.Node) -> bool:
    torch_rule = _torch_must_be_in_backward()
    return torch_rule is not None and bool(torch_rule(n))


@functools.lru_cache(maxsize=1)
def _free_object_types() -> tuple:
    kinds = [torch.ScriptObject]
    try:
        from torch.fx.experimental._backward_state import BackwardState
        kinds.append(BackwardState)
    except ImportError:
        pass
    try:
        from torch._library.fake_class_registry import FakeScriptObject
        kinds.append(FakeScriptObject)
    except ImportError:
        pass
    return tuple(kinds)


def is_free_object(node: fx.Node, val) -> bool:
    """A non-tensor value the backward may take by reference at no cost, as torch's partitioner
    treats it: compiled autograd's BackwardState, a (fake) script object, an opaque object."""
    return isinstance(val, _free_object_types()) or extract.is_opaque_node(node)


def is_symint_like(val) -> bool:
    """True for a symbolic int or bool (a dynamic size, or a guard on one)."""
    return isinstance(val, (torch.SymInt, torch.SymBool))


def export_joint_graph(
    gm: fx.GraphModule,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: Iterable[int] = (),
    parameter_indices: Optional[Sequence[int]] = None,
) -> ExportedJointGraph:
    """The joint graph as the arrays the C++ partition reads (fx_arrays.export_joint_graph),
    each node described by the rules of this module. static_lifetime_input_indices and
    parameter_indices count primals."""
    static = set(static_lifetime_input_indices)
    params = set(static if parameter_indices is None else parameter_indices)
    replay = extract.can_replay_rng()
    primal_index = 0

    def describe(node: fx.Node) -> NodeFacts:
        nonlocal primal_index
        op_class = classify(node)
        f = 0
        if replay and op_class == OpClass.RANDOM and draws_randomness(node):
            f |= NodeFlag.RNG_REPLAYABLE
        if node.op != "placeholder":
            # torch's rule binds only nodes with a partitioner tag
            if "partitioner_tag" in node.meta and _must_be_in_backward(node):
                f |= NodeFlag.MUST_BE_IN_BACKWARD
        elif is_primal(node):
            f |= NodeFlag.PRIMAL
            if primal_index in static:
                f |= NodeFlag.STATIC_INPUT
            if primal_index in params:
                f |= NodeFlag.PARAMETER
            if node.meta.get(COPIED_WHEN_SAVED):
                f |= NodeFlag.COPIED_WHEN_SAVED
            primal_index += 1
        elif is_tangent(node) or is_bwd_seed(node):
            f |= NodeFlag.BACKWARD_INPUT
        elif is_fwd_seed(node):
            f |= NodeFlag.FORWARD_SEED
        if node.meta.get(PIN_TO_FORWARD):
            f |= NodeFlag.PINNED_TO_FORWARD
        nbytes = 0.0
        val = node.meta.get("val", node.meta.get("tensor_meta"))
        if isinstance(val, torch.SymFloat):
            f |= NodeFlag.SYM_FLOAT
        elif is_symint_like(val):
            f |= NodeFlag.SYM_INT
            nbytes = _SYMINT_BYTES
        elif isinstance(val, torch.Tensor):
            nbytes = value_bytes(val)
        elif not is_free_object(node, val):  # free objects: saved by reference, cost 0
            f |= NodeFlag.NON_TENSOR
            nbytes = value_bytes(val)
        tag, ac_graph_id = _NO_TAG, -1
        if node.meta.get("recompute") is not None:
            tag = _TAGS.get(node.meta["recompute"], _NO_TAG)
            ac_graph_id = int(node.meta.get("ac_graph_id", -1))
        return NodeFacts(nbytes, _CLASS_IDS[op_class], int(f), tag, ac_graph_id)

    return fx_arrays.export_joint_graph(gm, num_fwd_outputs, describe)
