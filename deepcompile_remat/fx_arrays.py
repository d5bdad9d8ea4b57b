"""The one bridge from FX graphs to the C++ core's arrays (csrc/graph, csrc/memsim).

Every array the native code reads is built here, the same way for the partitioner
(partition/fx_export.py: the joint graph) and the ZeRO-3 schedule (zero3/: memory and bucket
arrays, also read by profile/):
- node ids are FX order without the output node (a topological order);
- an edge producer -> consumer per distinct input node, in the consumer's input order;
- a value's bytes come from fx_values.value_bytes (symbolic sizes costed the same on every rank).

What a node *is* for the cut (op class, flags, recompute tag) is the partitioner's business:
export_joint_graph takes it as a function of the node.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, Optional

import numpy as np
import torch.fx as fx
import torch.utils._pytree as pytree

from deepcompile_remat.fx_values import is_alias, value_bytes


@dataclass(frozen=True, slots=True)
class GraphArrays:
    """A graph's nodes (id -> node), node -> id, and its data edges (producer -> consumer
    ids)."""
    nodes: list
    ids: dict               # node -> id, built once with the nodes
    edge_tails: np.ndarray  # int64
    edge_heads: np.ndarray  # int64


def graph_arrays(gm: fx.GraphModule) -> GraphArrays:
    """Node ids and data edges of `gm` (module docstring)."""
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    ids = {n: i for i, n in enumerate(nodes)}
    tails: list[int] = []
    heads: list[int] = []
    for i, node in enumerate(nodes):
        for producer in dict.fromkeys(node.all_input_nodes):
            tails.append(ids[producer])
            heads.append(i)
    return GraphArrays(nodes, ids, np.asarray(tails, dtype=np.int64),
                       np.asarray(heads, dtype=np.int64))


class MemoryArrays(NamedTuple):
    """A graph as csrc/memsim's MemoryGraph, plus its nodes; unpacks in this order."""
    nodes: list
    bytes: np.ndarray       # float64; 0 for aliases (they share their base's storage)
    alias_of: np.ndarray    # int64: the base node's id, or -1
    is_input: np.ndarray    # uint8: placeholders and module constants, alive before step 0
    persistent: np.ndarray  # uint8: never freed (constants, the named inputs)
    keep: np.ndarray        # uint8: graph outputs
    edge_tails: np.ndarray  # int64
    edge_heads: np.ndarray  # int64


def memory_arrays(gm: fx.GraphModule, persistent_names: Iterable[str] = (), *,
                  graph: Optional[GraphArrays] = None) -> MemoryArrays:
    """`gm` as memsim arrays; inputs named in persistent_names (parameter shards: the module
    holds them) are never freed. graph: graph_arrays(gm), if the caller already built it (for
    its ids)."""
    persistent_names = set(persistent_names)
    graph = graph_arrays(gm) if graph is None else graph
    ids = graph.ids
    n = len(graph.nodes)
    nbytes = np.zeros(n)
    alias_of = np.full(n, -1, dtype=np.int64)
    is_input = np.zeros(n, dtype=np.uint8)
    persistent = np.zeros(n, dtype=np.uint8)
    keep = np.zeros(n, dtype=np.uint8)
    for i, node in enumerate(graph.nodes):
        is_input[i] = node.op in ("placeholder", "get_attr")
        persistent[i] = node.op == "get_attr" or node.name in persistent_names
        if is_alias(node) and isinstance(node.args[0], fx.Node):
            alias_of[i] = ids[node.args[0]]
        else:
            nbytes[i] = value_bytes(node.meta.get("val"))
    out = gm.graph.find_nodes(op="output")[0]
    for x in out.all_input_nodes:
        keep[ids[x]] = 1
    return MemoryArrays(graph.nodes, nbytes, alias_of, is_input, persistent, keep,
                        graph.edge_tails, graph.edge_heads)


def compatibility_keys(keys: list) -> np.ndarray:
    """One int64 per entry of `keys` (hashable values): equal values get equal ids. Ids follow
    the order of str(value), ties by first appearance, so a C++ rule that orders by key orders
    as the values' text would."""
    first = list(dict.fromkeys(keys))
    rank = {k: r for r, k in enumerate(sorted(first, key=str))}
    return np.asarray([rank[k] for k in keys], dtype=np.int64)


class NodeFacts(NamedTuple):
    """What the cut needs to know of one joint-graph node (csrc/graph/joint_graph.h)."""
    bytes: float
    op_class: int     # _C.OpClass
    flags: int        # _C.NodeFlag bits
    recompute: int    # _C.RecomputeTag
    ac_graph_id: int  # -1: none


@dataclass(frozen=True, slots=True)
class ExportedJointGraph:
    """The joint graph as csrc/graph's JointGraphView arrays, plus id -> node."""
    nodes: list
    bytes: np.ndarray        # float64
    op_class: np.ndarray     # uint8
    flags: np.ndarray        # uint32
    recompute: np.ndarray    # int8
    ac_graph_id: np.ndarray  # int64
    edge_tails: np.ndarray
    edge_heads: np.ndarray
    fwd_outputs: np.ndarray  # int64 ids
    bwd_outputs: np.ndarray

    def arrays(self) -> tuple:
        """The arrays in _C.partition_joint_graph's argument order."""
        return (self.bytes, self.op_class, self.flags, self.recompute, self.ac_graph_id,
                self.edge_tails, self.edge_heads, self.fwd_outputs, self.bwd_outputs)


def output_nodes(gm: fx.GraphModule, num_fwd_outputs: int) -> tuple[list, list]:
    """Forward and backward outputs of a joint graph (non-node outputs dropped)."""
    out = gm.graph.find_nodes(op="output")[0]
    leaves = pytree.arg_tree_leaves(*out.args)
    fwd = [x for x in leaves[:num_fwd_outputs] if isinstance(x, fx.Node)]
    bwd = [x for x in leaves[num_fwd_outputs:] if isinstance(x, fx.Node)]
    return fwd, bwd


def export_joint_graph(gm: fx.GraphModule, num_fwd_outputs: int,
                       describe: Callable[[fx.Node], NodeFacts]) -> ExportedJointGraph:
    """The joint graph's arrays; describe(node) is called once per node, in id order."""
    graph = graph_arrays(gm)
    ids = graph.ids
    n = len(graph.nodes)
    nbytes = np.zeros(n, dtype=np.float64)
    op_class = np.zeros(n, dtype=np.uint8)
    flags = np.zeros(n, dtype=np.uint32)
    recompute = np.zeros(n, dtype=np.int8)
    ac_graph_id = np.full(n, -1, dtype=np.int64)
    for i, node in enumerate(graph.nodes):
        facts = describe(node)
        nbytes[i], op_class[i], flags[i] = facts.bytes, facts.op_class, facts.flags
        recompute[i], ac_graph_id[i] = facts.recompute, facts.ac_graph_id
    fwd, bwd = output_nodes(gm, num_fwd_outputs)
    return ExportedJointGraph(
        graph.nodes, nbytes, op_class, flags, recompute, ac_graph_id,
        graph.edge_tails, graph.edge_heads,
        np.asarray([ids[x] for x in fwd], dtype=np.int64),
        np.asarray([ids[x] for x in bwd], dtype=np.int64))
