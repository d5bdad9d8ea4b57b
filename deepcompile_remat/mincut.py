"""Exact minimum s-t cut, solved in C++ (csrc/maxflow).

    cut = min_st_cut(num_nodes, tails, heads, capacities, source, sink)
    cut.value, cut.source_side, cut.cut_arcs

Capacities are float64; ``math.inf`` marks an arc that may never be cut. The GIL is released
while the solver runs. Inputs are validated here (types) and in C++ (values), and every error
names the argument and the index at fault.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np

from deepcompile_remat import _C

UnboundedCutError = _C.UnboundedCutError  # documented in the package's __init__

ArrayLike = Union[Sequence[int], Sequence[float], np.ndarray]

_ALGORITHMS = {
    "boykov_kolmogorov": _C.MaxFlowAlgorithm.boykov_kolmogorov,
    "dinic": _C.MaxFlowAlgorithm.dinic,
}


@dataclass(frozen=True)
class MinCut:
    """A minimum s-t cut and the maximum flow that proves it (min_st_cut's result)."""
    value: float
    """Capacity of the cut: the sum of capacities of `cut_arcs`."""
    source_side: np.ndarray
    """bool[num_nodes], True for nodes reachable from the source in the final residual graph."""
    cut_arcs: np.ndarray
    """int64 indices of the arcs from the source side to the sink side, ascending."""
    flow_value: float
    """Value of the maximum flow (equals `value` up to float rounding)."""


def _int_array(name: str, values: ArrayLike) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integer node ids, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.max() > np.iinfo(np.int64).max:
        i = int(np.argmax(arr > np.iinfo(np.int64).max))
        raise ValueError(f"{name}[{i}] = {int(arr[i])} is out of range (exceeds int64)")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _float_array(name: str, values: ArrayLike) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.float64)
    if arr.dtype == np.bool_ or not (
        np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)
    ):
        raise TypeError(f"{name} must hold real numbers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.float64)


def _index(name: str, value: object) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None


def min_st_cut(
    num_nodes: int,
    tails: ArrayLike,
    heads: ArrayLike,
    capacities: ArrayLike,
    source: int,
    sink: int,
    *,
    algorithm: str = "dinic",
) -> MinCut:
    """Minimum cut separating `source` from `sink` on arcs ``tails[i] -> heads[i]``.

    Raises UnboundedCutError (a ValueError) when no finite cut exists, ValueError for bad
    values (negative/NaN capacity, node id out of range, source == sink, length mismatch) and
    TypeError for wrong types.
    """
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"algorithm must be one of {sorted(_ALGORITHMS)}, got {algorithm!r}")
    cut = _C.min_st_cut(
        num_nodes=_index("num_nodes", num_nodes),
        tails=_int_array("tails", tails),
        heads=_int_array("heads", heads),
        capacities=_float_array("capacities", capacities),
        source=_index("source", source),
        sink=_index("sink", sink),
        algorithm=_ALGORITHMS[algorithm],
    )
    return MinCut(value=cut.value, source_side=cut.source_side.astype(bool),
                  cut_arcs=cut.cut_arcs, flow_value=cut.flow_value)


@dataclass(frozen=True)
class SplitNetwork:
    """Node-split flow network: node v is arcs ``2v -> 2v+1`` (arc index v) of capacity cost."""

    num_nodes: int
    tails: np.ndarray
    heads: np.ndarray
    capacities: np.ndarray
    source: int
    sink: int


def split_network(
    node_costs: ArrayLike,
    edge_tails: ArrayLike,
    edge_heads: ArrayLike,
    source_nodes: ArrayLike,
    sink_nodes: ArrayLike,
) -> SplitNetwork:
    """Builds the node-split network of a graph whose nodes carry costs (see node_split.h)."""
    net = _C.split_network(
        node_costs=_float_array("node_costs", node_costs),
        edge_tails=_int_array("edge_tails", edge_tails),
        edge_heads=_int_array("edge_heads", edge_heads),
        source_nodes=_int_array("source_nodes", source_nodes),
        sink_nodes=_int_array("sink_nodes", sink_nodes),
    )
    return SplitNetwork(num_nodes=net.num_nodes, tails=net.tails, heads=net.heads,
                        capacities=net.capacities, source=net.source, sink=net.sink)


def min_node_cut(
    node_costs: ArrayLike,
    edge_tails: ArrayLike,
    edge_heads: ArrayLike,
    source_nodes: ArrayLike,
    sink_nodes: ArrayLike,
    *,
    algorithm: str = "dinic",
) -> tuple[float, np.ndarray]:
    """Cheapest set of nodes separating `source_nodes` from `sink_nodes`: (cost, node ids)."""
    net = split_network(node_costs, edge_tails, edge_heads, source_nodes, sink_nodes)
    cut = min_st_cut(net.num_nodes, net.tails, net.heads, net.capacities, net.source, net.sink,
                     algorithm=algorithm)
    n = len(net.capacities) and (net.num_nodes - 2) // 2
    return cut.value, cut.cut_arcs[cut.cut_arcs < n]
