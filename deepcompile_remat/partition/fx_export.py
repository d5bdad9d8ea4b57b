"""Exports an AOTAutograd joint graph as the arrays the C++ partition reads (JointGraphView).

Node ids are FX order (a topological order). Sizes come from ``meta["val"]`` through
``fx_values.value_bytes`` (symbolic sizes costed the same on every rank; see there).
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy

from deepcompile_remat.fx_values import value_bytes
from deepcompile_remat.partition import extract
from deepcompile_remat.partition.op_classes import OpClass, classify


class NodeFlag(enum.IntFlag):  # mirrors dcr::NodeFlag
    PRIMAL = 1 << 0
    BACKWARD_INPUT = 1 << 1
    FORWARD_SEED = 1 << 2
    STATIC_INPUT = 1 << 3
    PARAMETER = 1 << 4
    NON_TENSOR = 1 << 5
    SYM_INT = 1 << 6
    SYM_FLOAT = 1 << 7
    MUST_BE_IN_BACKWARD = 1 << 8
    RNG_REPLAYABLE = 1 << 9


_TAGS = {  # CheckpointPolicy -> dcr::RecomputeTag
    CheckpointPolicy.MUST_SAVE: 1,
    CheckpointPolicy.PREFER_SAVE: 2,
    CheckpointPolicy.MUST_RECOMPUTE: 3,
    CheckpointPolicy.PREFER_RECOMPUTE: 4,
}
_SYMINT_BYTES = 8


def is_tangent(n: fx.Node) -> bool:
    return n.op == "placeholder" and "tangents" in str(n.target)


def is_fwd_seed(n: fx.Node) -> bool:
    t = str(n.target)
    return n.op == "placeholder" and ("fwd_seed" in t or "fwd_base_offset" in t)


def is_bwd_seed(n: fx.Node) -> bool:
    t = str(n.target)
    return n.op == "placeholder" and ("bwd_seed" in t or "bwd_base_offset" in t)


def is_primal(n: fx.Node) -> bool:
    return n.op == "placeholder" and not (is_tangent(n) or is_fwd_seed(n) or is_bwd_seed(n))


def _must_be_in_backward(n: fx.Node) -> bool:
    try:  # torch's own rule (partitioner tags, mutations in backward); absent in old builds
        from torch._functorch.partitioners import _must_be_in_backward as torch_rule
    except ImportError:
        return False
    return bool(torch_rule(n))


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
    return isinstance(val, (torch.SymInt, torch.SymBool))


def output_nodes(gm: fx.GraphModule, num_fwd_outputs: int) -> tuple[list[fx.Node], list[fx.Node]]:
    """Forward and backward outputs of a joint graph (non-node outputs dropped)."""
    out = gm.graph.find_nodes(op="output")[0]
    leaves = pytree.arg_tree_leaves(*out.args)
    fwd = [x for x in leaves[:num_fwd_outputs] if isinstance(x, fx.Node)]
    bwd = [x for x in leaves[num_fwd_outputs:] if isinstance(x, fx.Node)]
    return fwd, bwd


@dataclass
class ExportedJointGraph:
    nodes: list[fx.Node]  # id -> node
    bytes: np.ndarray
    op_class: np.ndarray
    flags: np.ndarray
    recompute: np.ndarray
    ac_graph_id: np.ndarray
    edge_tails: np.ndarray
    edge_heads: np.ndarray
    fwd_outputs: np.ndarray
    bwd_outputs: np.ndarray

    def arrays(self) -> tuple:
        return (self.bytes, self.op_class, self.flags, self.recompute, self.ac_graph_id,
                self.edge_tails, self.edge_heads, self.fwd_outputs, self.bwd_outputs)


def export_joint_graph(
    gm: fx.GraphModule,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: Iterable[int] = (),
    parameter_indices: Optional[Sequence[int]] = None,
) -> ExportedJointGraph:
    static = set(static_lifetime_input_indices)
    params = set(static if parameter_indices is None else parameter_indices)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    ids = {n: i for i, n in enumerate(nodes)}
    n = len(nodes)
    nbytes = np.zeros(n, dtype=np.float64)
    op_class = np.zeros(n, dtype=np.uint8)
    flags = np.zeros(n, dtype=np.uint32)
    recompute = np.zeros(n, dtype=np.int8)
    ac_graph_id = np.full(n, -1, dtype=np.int64)
    tails: list[int] = []
    heads: list[int] = []
    primal_index = 0
    replay = extract.can_replay_rng()
    for i, node in enumerate(nodes):
        op_class[i] = classify(node)
        f = NodeFlag(0)
        if replay and op_class[i] == OpClass.RANDOM and extract.is_seeded_random(node):
            f |= NodeFlag.RNG_REPLAYABLE
        if is_primal(node):
            f |= NodeFlag.PRIMAL
            if primal_index in static:
                f |= NodeFlag.STATIC_INPUT
            if primal_index in params:
                f |= NodeFlag.PARAMETER
            primal_index += 1
        elif is_tangent(node) or is_bwd_seed(node):
            f |= NodeFlag.BACKWARD_INPUT
        elif is_fwd_seed(node):
            f |= NodeFlag.FORWARD_SEED
        if node.op != "placeholder" and _must_be_in_backward(node):
            f |= NodeFlag.MUST_BE_IN_BACKWARD
        val = node.meta.get("val", node.meta.get("tensor_meta"))
        if isinstance(val, torch.SymFloat):
            f |= NodeFlag.SYM_FLOAT
        elif is_symint_like(val):
            f |= NodeFlag.SYM_INT
            nbytes[i] = _SYMINT_BYTES
        elif isinstance(val, torch.Tensor):
            nbytes[i] = value_bytes(val)
        elif not is_free_object(node, val):  # free objects: saved by reference, cost 0
            f |= NodeFlag.NON_TENSOR
            nbytes[i] = value_bytes(val)
        flags[i] = int(f)
        tag = node.meta.get("recompute")
        if tag is not None:
            recompute[i] = _TAGS.get(tag, 0)
            ac_graph_id[i] = int(node.meta.get("ac_graph_id", -1))
        for producer in dict.fromkeys(node.all_input_nodes):
            tails.append(ids[producer])
            heads.append(i)
    fwd, bwd = output_nodes(gm, num_fwd_outputs)
    return ExportedJointGraph(
        nodes, nbytes, op_class, flags, recompute, ac_graph_id,
        np.asarray(tails, dtype=np.int64), np.asarray(heads, dtype=np.int64),
        np.asarray([ids[x] for x in fwd], dtype=np.int64),
        np.asarray([ids[x] for x in bwd], dtype=np.int64),
    )
