"""The one bridge from FX graphs to the C++ core's graphs (csrc/graph, csrc/memsim).

Every graph the native code reads is built here, the same way for the partitioner
(partition/fx_export.py: the joint graph, _C.JointGraph) and the ZeRO-3 schedule (zero3/: the
memory graph, _C.MemoryGraph, and bucket arrays; also read by profile/). Both are bound C++
classes built by keyword and read by attribute: an array is passed and read by its name,
never by position.
- node ids are FX order without the output node (a topological order);
- an edge producer -> consumer per distinct input node, in the consumer's input order;
- a value's bytes come from fx_values.value_bytes (symbolic sizes costed the same on every rank).

What a node *is* for the cut (op class, flags, recompute tag) is the partitioner's business:
export_joint_graph takes it as a function of the node, whose NodeFacts fields are the
JointGraph's per-node arrays by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, NamedTuple, Optional

import numpy as np
import torch.fx as fx
import torch.utils._pytree as pytree

from deepcompile_remat import _C
from deepcompile_remat.fx_values import is_alias, value_bytes

# node.meta keys a runtime's joint-graph pass may set (the ZeRO-3 secondary shards do), read
# when the graph is exported for the cut (partition/fx_export.py, partition/budget.py):
# PIN_TO_FORWARD: the cut treats the node as a forward node even where no forward output needs
# it (NodeFlag.PINNED_TO_FORWARD); RECOMPUTE_PRICE: what recomputing it costs in the memory-
# budget sweep, in its flops units (budget.recompute_cost_of), in place of the op's own count;
# OP_CLASS: the node's _C.OpClass, in place of what partition/op_classes.py would say of its op
# (a runtime's own op that is no alias of what it reads: a copy out of a gathered weight).
# ON_HOST: the node's value lives in host memory (partition/offload.py's copies), which the
# memory simulator does not count (memory_graph allocates it 0 bytes).
ON_HOST = "partition_on_host"
# COPIED_WHEN_SAVED: a placeholder the compiler writes out as a copy when the forward saves it
# (partition/layouts.py: inductor's channels-last conv weights): the cut prices saving it
# (NodeFlag.COPIED_WHEN_SAVED) and the memory simulator counts a saved one's copy.
COPIED_WHEN_SAVED = "partition_copied_when_saved"
# SCRATCH_BYTES: bytes a node's op allocates and frees inside its own call, which no graph value
# shows (a collective's packed buffers): set by whoever knows the op (zero3/scratch.py), counted
# at that node's step by the memory simulator (priced_scratch, read by
# partition/simulate.op_workspace and by the runtime's own schedules).
SCRATCH_BYTES = "partition_scratch_bytes"
PIN_TO_FORWARD = "partition_pin_to_forward"
RECOMPUTE_PRICE = "partition_recompute_price"
OP_CLASS = "partition_op_class"


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


def priced_scratch(gm: fx.GraphModule) -> dict:
    """{node: bytes} of `gm`'s nodes whose owner priced their op's scratch (SCRATCH_BYTES)."""
    return {n: float(n.meta[SCRATCH_BYTES]) for n in gm.graph.nodes if n.meta.get(SCRATCH_BYTES)}


def memory_graph(gm: fx.GraphModule, persistent_names: Iterable[str] = (), *,
                 graph: Optional[GraphArrays] = None,
                 no_buffer: Iterable[fx.Node] = (),
                 workspace: Optional[Mapping[fx.Node, float]] = None) -> _C.MemoryGraph:
    """`gm` as csrc/memsim's MemoryGraph (node ids: graph's). Aliases allocate 0 bytes (they
    share their base's storage); placeholders and module constants are inputs, alive before
    step 0; inputs named in persistent_names (parameter shards: the module holds them) and
    constants are never freed; graph outputs are kept. graph: graph_arrays(gm), if the caller
    already built it (for its ids). no_buffer: nodes that allocate nothing (a compiler fuses
    them into their consumers' kernels). A node marked ON_HOST holds no accelerator bytes.
    workspace: scratch bytes of nodes whose op allocates and frees some inside its call."""
    persistent_names = set(persistent_names)
    no_buffer = set(no_buffer)
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
        elif node not in no_buffer and not node.meta.get(ON_HOST):
            nbytes[i] = value_bytes(node.meta.get("val"))
    out = gm.graph.find_nodes(op="output")[0]
    for x in out.all_input_nodes:
        keep[ids[x]] = 1
    scratch = np.zeros(n if workspace else 0)
    for node, b in (workspace or {}).items():
        scratch[ids[node]] = b
    return _C.MemoryGraph(bytes=nbytes, alias_of=alias_of, is_input=is_input,
                          persistent=persistent, keep=keep, workspace=scratch,
                          edge_tails=graph.edge_tails, edge_heads=graph.edge_heads)


def compatibility_keys(keys: list) -> np.ndarray:
    """One int64 per entry of `keys` (hashable values): equal values get equal ids. Ids follow
    the order of str(value), ties by first appearance, so a C++ rule that orders by key orders
    as the values' text would."""
    first = list(dict.fromkeys(keys))
    rank = {k: r for r, k in enumerate(sorted(first, key=str))}
    return np.asarray([rank[k] for k in keys], dtype=np.int64)


class NodeFacts(NamedTuple):
    """What the cut needs to know of one joint-graph node (csrc/graph/joint_graph.h). Each
    field is the _C.JointGraph array of that name: a new per-node array is a field here."""
    bytes: float
    op_class: int     # _C.OpClass
    flags: int        # _C.NodeFlag bits
    recompute: int    # _C.RecomputeTag
    ac_graph_id: int  # -1: none


class ExportedJointGraph(_C.JointGraph):
    """The joint graph as the bound csrc/graph JointGraph (its arrays by attribute: bytes,
    flags, edge_tails, ...; the C++ entry points take it as is), plus `nodes`: id -> FX node."""

    def __init__(self, nodes: list, **arrays):
        super().__init__(**arrays)
        self.nodes = nodes


def output_nodes(gm: fx.GraphModule, num_fwd_outputs: int) -> tuple[list, list]:
    """Forward and backward outputs of a joint graph (non-node outputs dropped)."""
    out = gm.graph.find_nodes(op="output")[0]
    leaves = pytree.arg_tree_leaves(*out.args)
    fwd = [x for x in leaves[:num_fwd_outputs] if isinstance(x, fx.Node)]
    bwd = [x for x in leaves[num_fwd_outputs:] if isinstance(x, fx.Node)]
    return fwd, bwd


def export_joint_graph(gm: fx.GraphModule, num_fwd_outputs: int,
                       describe: Callable[[fx.Node], NodeFacts]) -> ExportedJointGraph:
    """The joint graph; describe(node) is called once per node, in id order."""
    graph = graph_arrays(gm)
    ids = graph.ids
    facts = [describe(node) for node in graph.nodes]
    per_node = dict(zip(NodeFacts._fields, map(list, zip(*facts))))
    fwd, bwd = output_nodes(gm, num_fwd_outputs)
    return ExportedJointGraph(
        graph.nodes, **per_node, edge_tails=graph.edge_tails, edge_heads=graph.edge_heads,
        fwd_outputs=[ids[x] for x in fwd], bwd_outputs=[ids[x] for x in bwd])
