"""Tests of the Python min-cut API (deepcompile_remat.mincut) over the C++ solver."""
from __future__ import annotations

import math
import threading
import time

import networkx as nx
import numpy as np
import pytest

from deepcompile_remat.mincut import (
    MinCut,
    UnboundedCutError,
    min_node_cut,
    min_st_cut,
    split_network,
)

ALGORITHMS = ["boykov_kolmogorov", "dinic"]
INF = math.inf


def cut_capacity(tails, heads, capacities, source_side) -> float:
    """Capacity of the arcs leaving `source_side` (a bool mask over nodes)."""
    tails, heads, capacities = np.asarray(tails), np.asarray(heads), np.asarray(capacities, float)
    leaving = source_side[tails] & ~source_side[heads]
    return float(capacities[leaving].sum())


# --------------------------------------------------------------------------------------------
# Basic use with lists and numpy arrays.

DIAMOND = dict(num_nodes=4, tails=[0, 0, 1, 2, 1], heads=[1, 2, 3, 3, 2],
               capacities=[3.0, 2.0, 1.0, 4.0, 5.0], source=0, sink=3)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_lists(algorithm):
    cut = min_st_cut(**DIAMOND, algorithm=algorithm)
    assert isinstance(cut, MinCut)
    assert cut.value == 5.0 and cut.flow_value == 5.0
    assert cut.source_side.dtype == np.bool_
    assert cut.source_side.tolist() == [True, False, False, False]
    assert cut.cut_arcs.dtype == np.int64
    assert cut.cut_arcs.tolist() == [0, 1]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_numpy_arrays_of_other_int_and_float_widths(algorithm):
    cut = min_st_cut(
        np.int32(4),
        np.array(DIAMOND["tails"], dtype=np.int32),
        np.array(DIAMOND["heads"], dtype=np.uint16),
        np.array(DIAMOND["capacities"], dtype=np.float32),
        np.int64(0),
        3,
        algorithm=algorithm,
    )
    assert cut.value == 5.0
    assert cut.cut_arcs.tolist() == [0, 1]


def test_integer_capacities_and_non_contiguous_views():
    tails = np.array([0, 9, 0, 9, 1, 9, 2, 9, 1, 9])[::2]
    heads = np.array(DIAMOND["heads"])
    capacities = np.array([3, 2, 1, 4, 5], dtype=np.int64)
    cut = min_st_cut(4, tails, heads, capacities, 0, 3)
    assert cut.value == 5.0


def test_no_arcs():
    cut = min_st_cut(3, [], [], [], 0, 2)
    assert cut.value == 0.0
    assert cut.source_side.tolist() == [True, False, False]
    assert cut.cut_arcs.size == 0


def test_infinite_arcs_are_never_cut():
    # s -inf-> 1 -5-> 2 -inf-> t and 1 -inf-> 3 -2-> 2: cut {1->2, 3->2}.
    cut = min_st_cut(5, [0, 1, 2, 1, 3], [1, 2, 4, 3, 2], [INF, 5, INF, INF, 2], 0, 4)
    assert cut.value == 7.0
    assert cut.cut_arcs.tolist() == [1, 4]


# --------------------------------------------------------------------------------------------
# Bad input: the error type, and a message naming the argument (and index).

GOOD = dict(num_nodes=3, tails=[0, 1, 0], heads=[1, 2, 2], capacities=[1.0, 2.0, 3.0],
            source=0, sink=2)


def with_(**changes):
    return {**GOOD, **changes}


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (with_(capacities=[1.0, -2.0, 3.0]), ValueError, r"capacities\[1\] = -2 is negative"),
        (with_(capacities=[1.0, 2.0, -INF]), ValueError, r"capacities\[2\]"),
        (with_(capacities=[math.nan, 2.0, 3.0]), ValueError, r"capacities\[0\] is NaN"),
        (with_(tails=[0, 3, 0]), ValueError, r"tails\[1\] = 3 is out of range"),
        (with_(tails=[0, 1, -1]), ValueError, r"tails\[2\] = -1 is out of range"),
        (with_(heads=[1, 2, 7]), ValueError, r"heads\[2\] = 7 is out of range"),
        (with_(heads=[-4, 2, 2]), ValueError, r"heads\[0\] = -4 is out of range"),
        (with_(source=2), ValueError, r"source and sink must differ"),
        (with_(source=3), ValueError, r"source = 3 is out of range"),
        (with_(source=-1), ValueError, r"source = -1 is out of range"),
        (with_(sink=5), ValueError, r"sink = 5 is out of range"),
        (with_(num_nodes=1, sink=0), ValueError, r"num_nodes must be >= 2"),
        (with_(heads=[1, 2]), ValueError, r"tails, heads and capacities must have one length"),
        (with_(capacities=[1.0]), ValueError, r"one length; got 3, 3 and 1"),
        (with_(tails=[0.0, 1.0, 0.0]), TypeError, r"tails must hold integer node ids"),
        (with_(heads=np.array([1, 2, 2], dtype=np.float32)), TypeError, r"heads must hold integer"),
        (with_(tails=["a", "b", "c"]), TypeError, r"tails must hold integer node ids"),
        (with_(tails=[True, False, True]), TypeError, r"tails must hold integer node ids"),
        (with_(capacities=["1", "2", "3"]), TypeError, r"capacities must hold real numbers"),
        (with_(capacities=[1 + 0j, 2, 3]), TypeError, r"capacities must hold real numbers"),
        (with_(tails=[[0, 1, 0]]), ValueError, r"tails must be one-dimensional"),
        (with_(heads=np.zeros((3, 1), dtype=np.int64)), ValueError, r"heads must be one-dim"),
        (with_(capacities=np.ones((3, 3))), ValueError, r"capacities must be one-dimensional"),
        (with_(source=0.0), TypeError, r"source must be an integer"),
        (with_(sink="2"), TypeError, r"sink must be an integer"),
        (with_(num_nodes=3.0), TypeError, r"num_nodes must be an integer"),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        min_st_cut(**kwargs)


def test_unknown_algorithm():
    with pytest.raises(ValueError, match="algorithm must be one of"):
        min_st_cut(**GOOD, algorithm="push_relabel")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_unbounded_cut_error_is_a_value_error_with_path(algorithm):
    # 0 -inf-> 1 -3-> 3 is finite, but 0 -inf-> 1 -inf-> 2 -inf-> 3 is not.
    tails, heads, capacities = [0, 1, 1, 2], [1, 3, 2, 3], [INF, 3.0, INF, INF]
    with pytest.raises(ValueError) as info:
        min_st_cut(4, tails, heads, capacities, 0, 3, algorithm=algorithm)
    assert isinstance(info.value, UnboundedCutError)
    assert list(info.value.path) == [0, 1, 2, 3]
    assert "0 -> 1 -> 2 -> 3" in str(info.value)


def test_split_network_bad_input():
    with pytest.raises(ValueError, match=r"node_costs\[1\]"):
        split_network([1.0, -1.0], [0], [1], [0], [1])
    with pytest.raises(ValueError, match=r"edge_heads\[0\] = 2 is out of range"):
        split_network([1.0, 1.0], [0], [2], [0], [1])
    with pytest.raises(ValueError, match=r"sink_nodes\[1\] = 5"):
        split_network([1.0, 1.0], [0], [1], [0], [1, 5])
    with pytest.raises(TypeError, match=r"source_nodes must hold integer"):
        split_network([1.0, 1.0], [0], [1], [0.5], [1])


# --------------------------------------------------------------------------------------------
# Random graphs against networkx.


def random_graph(rng: np.random.Generator):
    """A random multigraph with 2..40 nodes; integer or real capacities, some +inf, some 0."""
    n = int(rng.integers(2, 41))
    m = int(rng.integers(0, 4 * n + 1))
    tails = rng.integers(0, n, m)
    heads = rng.integers(0, n, m)
    if rng.random() < 0.5:
        capacities = rng.integers(0, 20, m).astype(float)
    else:
        capacities = rng.random(m) * 10.0
    capacities[rng.random(m) < rng.choice([0.0, 0.2, 0.5])] = INF
    source = int(rng.integers(0, n))
    sink = int((source + rng.integers(1, n)) % n)
    return n, tails, heads, capacities, source, sink


def networkx_digraph(n, tails, heads, capacities):
    """networkx wants a simple digraph: parallel arcs are merged (capacities add), self-loops
    dropped, and an infinite capacity is an edge without a 'capacity' attribute."""
    merged: dict[tuple[int, int], float] = {}
    for u, v, c in zip(tails.tolist(), heads.tolist(), capacities.tolist()):
        if u != v:
            merged[(u, v)] = merged.get((u, v), 0.0) + c
    graph = nx.DiGraph()
    graph.add_nodes_from(range(n))
    for (u, v), c in merged.items():
        if math.isinf(c):
            graph.add_edge(u, v)
        else:
            graph.add_edge(u, v, capacity=c)
    return graph


def test_random_graphs_match_networkx():
    rng = np.random.default_rng(20240531)
    outcomes = {"bounded": 0, "unbounded": 0}
    for trial in range(1000):
        n, tails, heads, capacities, s, t = random_graph(rng)
        graph = networkx_digraph(n, tails, heads, capacities)
        try:
            expected, _ = nx.minimum_cut(graph, s, t)
        except nx.NetworkXUnbounded:
            expected = None
        for algorithm in ALGORITHMS:
            context = f"trial {trial}, {algorithm}"
            if expected is None:
                with pytest.raises(UnboundedCutError):
                    min_st_cut(n, tails, heads, capacities, s, t, algorithm=algorithm)
                continue
            cut = min_st_cut(n, tails, heads, capacities, s, t, algorithm=algorithm)
            assert math.isclose(cut.value, expected, rel_tol=1e-9, abs_tol=1e-12), context
            assert cut.source_side[s] and not cut.source_side[t], context
            own = cut_capacity(tails, heads, capacities, cut.source_side)
            assert math.isclose(own, expected, rel_tol=1e-9, abs_tol=1e-12), context
        outcomes["unbounded" if expected is None else "bounded"] += 1
    # Both outcomes must actually be exercised.
    assert outcomes["bounded"] > 700 and outcomes["unbounded"] > 40, outcomes


# --------------------------------------------------------------------------------------------
# The GIL is released during the solve.


def layered_graph(layers: int, width: int, seed: int = 0):
    """Layers of `width` nodes, each arc to a random node of the next layer; slow enough to
    take a measurable time to cut."""
    rng = np.random.default_rng(seed)
    n = layers * width + 2
    s, t = n - 2, n - 1
    tails = np.repeat(np.arange((layers - 1) * width), 3)
    heads = (tails // width + 1) * width + rng.integers(0, width, tails.size)
    capacities = rng.integers(1, 100, tails.size).astype(float)
    first, last = np.arange(width), np.arange((layers - 1) * width, layers * width)
    tails = np.concatenate([tails, np.full(width, s), last])
    heads = np.concatenate([heads, first, np.full(width, t)])
    capacities = np.concatenate([capacities, np.full(2 * width, INF)])
    return n, tails, heads, capacities, s, t


def test_gil_is_released_during_the_solve():
    # The main thread stamps the clock about every millisecond while a worker thread solves.
    # If the solver held the GIL, no stamp could fall inside the solve; the middle half of the
    # solve is used so that GIL hand-overs just before and after the C++ call do not count.
    layers = 20
    while True:
        graph = layered_graph(layers, 200)
        window: dict[str, float] = {}
        results: list[MinCut] = []

        def solve():
            window["start"] = time.perf_counter()
            results.append(min_st_cut(*graph))
            window["end"] = time.perf_counter()

        stamps: list[float] = []
        worker = threading.Thread(target=solve)
        worker.start()
        while worker.is_alive():
            stamps.append(time.perf_counter())
            time.sleep(0.001)
        worker.join()
        duration = window["end"] - window["start"]
        if duration >= 0.2 or layers >= 640:
            break
        layers *= 2
    assert results and results[0].value > 0
    assert duration >= 0.1, "the solve was too fast to observe"
    lo = window["start"] + 0.25 * duration
    hi = window["end"] - 0.25 * duration
    inside = sum(lo < stamp < hi for stamp in stamps)
    assert inside >= 5, f"{inside} main-thread stamps during a {duration:.3f} s solve"


# --------------------------------------------------------------------------------------------
# Node cuts: the seeds' example y = cos(cos(a + b + c + d)).


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_min_node_cut_saves_only_the_sum(algorithm):
    a, b, c, d, total, cos1, cos2, tangent, grad_cos1, grad_sum = range(10)
    edges = [(a, total), (b, total), (c, total), (d, total), (total, cos1), (cos1, cos2),
             (cos1, grad_cos1), (tangent, grad_cos1), (total, grad_sum), (grad_cos1, grad_sum)]
    # Fusible cost model: materialized tensors cost their bytes, pointwise results 2x.
    costs = [4096.0] * 10
    for pointwise in (total, cos1, cos2):
        costs[pointwise] = 2 * 4096.0
    tails, heads = zip(*edges)
    value, nodes = min_node_cut(costs, tails, heads, [a, b, c, d],
                                [tangent, grad_cos1, grad_sum], algorithm=algorithm)
    assert value == 8192.0
    assert nodes.tolist() == [total]


def test_min_node_cut_prefers_the_cheaper_frontier():
    # Same shape, but the sum is huge: saving the four inputs is now cheaper.
    a, b, c, d, total, out = range(6)
    costs = [1.0, 1.0, 1.0, 1.0, 100.0, 100.0]
    value, nodes = min_node_cut(costs, [a, b, c, d, total], [total] * 4 + [out],
                                [a, b, c, d], [out])
    assert value == 4.0
    assert nodes.tolist() == [a, b, c, d]


def test_split_network_layout():
    net = split_network([3.0, 5.0], [0], [1], [0], [1])
    assert net.num_nodes == 6 and net.source == 4 and net.sink == 5
    assert net.tails.tolist() == [0, 2, 1, 4, 2]
    assert net.heads.tolist() == [1, 3, 2, 0, 5]
    assert net.capacities.tolist() == [3.0, 5.0, INF, INF, INF]
