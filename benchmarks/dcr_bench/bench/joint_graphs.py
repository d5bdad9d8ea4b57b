"""Synthetic joint forward/backward graphs shaped like transformer training graphs.

Each of L stacked layers has a pre-norm attention block and an MLP block: matmuls (their
outputs are materialized, so saving one costs its bytes), pointwise chains (fusible, so
saving a value costs 2x its bytes, the fusible cost model of the min-cut partitioner),
one value fanned out to several users (the normed input feeds q, k and v), and residual adds
whose edges skip the block. The backward mirrors the forward: one gradient node per
differentiable input of each op, consuming the incoming gradient and the forward values the
op saves (matmuls their inputs, pointwise ops their input), plus an accumulation node where a
value has several users.

Terminals follow the min-cut formulation: primal inputs (the first activation and the
weights) are source nodes, and so are matmul outputs, whose recomputation is banned as too
expensive (without that ban the cheapest cut would save the primals and recompute the whole
forward); every backward node is a sink node (the tangent closure). Costs
are integer byte counts, multiples of 4096, so every cut value is exact in float64.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PAGE = 4096


@dataclass(frozen=True)
class JointGraph:
    """A synthetic joint graph as the flow-network arrays take it: per-node save costs, data
    edges, and the source and sink terminals of the min-cut formulation."""
    node_costs: np.ndarray  # float64[n], cost of saving each node (bytes, x2 if fusible)
    edge_tails: np.ndarray  # int64[e], data edges producer -> consumer
    edge_heads: np.ndarray
    source_nodes: np.ndarray  # primal inputs
    sink_nodes: np.ndarray  # backward nodes
    num_layers: int

    @property
    def num_nodes(self) -> int:
        """Nodes in the joint graph (before the node split doubles them)."""
        return len(self.node_costs)


@dataclass(frozen=True)
class _Op:
    output: int
    inputs: tuple[int, ...]
    saves_inputs: bool  # whether its backward needs the forward inputs (add does not)


class _Builder:
    """Accumulates nodes and edges; forward ops are remembered to mirror them backward."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.costs: list[float] = []
        self.sizes: list[int] = []
        self.tails: list[int] = []
        self.heads: list[int] = []
        self.sources: list[int] = []
        self.sinks: list[int] = []
        self.ops: list[_Op] = []

    def _bytes(self, nominal: int) -> int:
        # A few pages of jitter so that equal-looking tensors do not all tie.
        return nominal + PAGE * int(self.rng.integers(0, 16))

    def node(self, nbytes: int, inputs: tuple[int, ...], fusible: bool) -> int:
        v = len(self.costs)
        self.costs.append(float(2 * nbytes if fusible else nbytes))
        self.sizes.append(nbytes)
        for u in inputs:
            self.tails.append(u)
            self.heads.append(v)
        return v

    def primal(self, nominal: int) -> int:
        v = self.node(self._bytes(nominal), (), fusible=False)
        self.sources.append(v)
        return v

    def op(self, nominal: int, inputs: tuple[int, ...], *, fusible: bool,
           saves_inputs: bool = True) -> int:
        v = self.node(self._bytes(nominal), inputs, fusible)
        self.ops.append(_Op(v, inputs, saves_inputs))
        return v

    def matmul(self, a: int, b: int, nominal: int) -> int:
        v = self.op(nominal, (a, b), fusible=False)
        self.sources.append(v)  # recomputation banned
        return v

    def pointwise_chain(self, x: int, nominal: int) -> int:
        for _ in range(int(self.rng.integers(2, 5))):
            x = self.op(nominal, (x,), fusible=True)
        return x

    def add(self, a: int, b: int, nominal: int) -> int:
        return self.op(nominal, (a, b), fusible=True, saves_inputs=False)

    def backward_node(self, nbytes: int, inputs: tuple[int, ...]) -> int:
        v = self.node(nbytes, inputs, fusible=False)
        self.sinks.append(v)
        return v


@dataclass(frozen=True)
class _Dims:
    """Nominal tensor bytes: bf16, 2048 tokens, hidden 1024, 16 heads, MLP 4x."""

    hidden: int = 2048 * 1024 * 2
    scores: int = 16 * 2048 * 2048 * 2
    mlp: int = 4 * 2048 * 1024 * 2
    weight: int = 1024 * 1024 * 2
    mlp_weight: int = 4 * 1024 * 1024 * 2


def _forward_layer(b: _Builder, x: int, d: _Dims) -> int:
    wq, wk, wv, wo = (b.primal(d.weight) for _ in range(4))
    w1, w2 = b.primal(d.mlp_weight), b.primal(d.mlp_weight)
    normed = b.pointwise_chain(x, d.hidden)  # layer norm; fans out to q, k and v
    q, k, v = (b.matmul(normed, w, d.hidden) for w in (wq, wk, wv))
    probs = b.pointwise_chain(b.matmul(q, k, d.scores), d.scores)  # softmax
    attn = b.matmul(b.matmul(probs, v, d.hidden), wo, d.hidden)
    x = b.add(x, attn, d.hidden)  # residual around attention
    hidden = b.pointwise_chain(b.matmul(b.pointwise_chain(x, d.hidden), w1, d.mlp), d.mlp)
    return b.add(x, b.matmul(hidden, w2, d.hidden), d.hidden)  # residual around the MLP


def _mirror_backward(b: _Builder, output: int) -> None:
    """Gradient nodes for every forward op, in reverse creation order (a topological order)."""
    contributions: dict[int, list[int]] = {output: [b.backward_node(b.sizes[output], ())]}
    for op in reversed(b.ops):
        incoming = contributions.pop(op.output, [])
        if not incoming:
            continue
        size = b.sizes[op.output]
        grad = incoming[0] if len(incoming) == 1 else b.backward_node(size, tuple(incoming))
        for i, x in enumerate(op.inputs):
            saved = tuple(u for j, u in enumerate(op.inputs) if j != i or len(op.inputs) == 1)
            needs = saved if op.saves_inputs else ()
            contributions.setdefault(x, []).append(b.backward_node(b.sizes[x], (grad, *needs)))
    # What is left are gradients of primal inputs: accumulate those with several parts.
    for parts in contributions.values():
        if len(parts) > 1:
            b.backward_node(b.sizes[parts[0]], tuple(parts))


def nodes_per_layer() -> int:
    """Approximate node count of one layer (forward + backward), for sizing."""
    return 62


def transformer_joint_graph(num_layers: int, seed: int = 0) -> JointGraph:
    """The joint graph of `num_layers` stacked blocks; deterministic for a given seed."""
    b = _Builder(np.random.default_rng(seed))
    dims = _Dims()
    x = b.primal(dims.hidden)
    for _ in range(num_layers):
        x = _forward_layer(b, x, dims)
    _mirror_backward(b, x)
    return JointGraph(
        node_costs=np.asarray(b.costs, dtype=np.float64),
        edge_tails=np.asarray(b.tails, dtype=np.int64),
        edge_heads=np.asarray(b.heads, dtype=np.int64),
        source_nodes=np.asarray(b.sources, dtype=np.int64),
        sink_nodes=np.asarray(b.sinks, dtype=np.int64),
        num_layers=num_layers,
    )


def joint_graph_with_about(num_nodes: int, seed: int = 0) -> JointGraph:
    """A joint graph with close to `num_nodes` nodes (whole layers, at least one)."""
    return transformer_joint_graph(max(1, round(num_nodes / nodes_per_layer())), seed)
