"""`deepcompile-remat bench-solver`: the exact min-cut solver against networkx.

For each size, builds a synthetic transformer joint graph (bench/joint_graphs.py), splits it
into a flow network, and times min_st_cut with Dinic (ours, the default) and
with Boykov-Kolmogorov (the cross-check), and networkx.minimum_cut with its default flow function (preflow-push). All
three cut values must agree. networkx is skipped from the first size where its previous
solve took, or is predicted by linear extrapolation in arcs to take, more than the limit.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from typing import Callable, Optional, Sequence

from dcr_bench.bench.joint_graphs import joint_graph_with_about
from dcr_bench.bench.tables import format_table
from deepcompile_remat.mincut import SplitNetwork, min_st_cut, split_network

NAME = "bench-solver"
DEFAULT_SIZES = (1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 200_000)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds bench-solver's flags (largest size, networkx time limit, seed) to `parser`."""
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows")
    parser.add_argument("--max-nodes", type=int, default=DEFAULT_SIZES[-1],
                        help="largest joint-graph size to run (default %(default)s)")
    parser.add_argument("--networkx-limit-s", type=float, default=60.0,
                        help="skip networkx above sizes whose solve takes longer "
                             "(default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="graph generator seed")


def run(args: argparse.Namespace) -> int:
    """Time the exact min-cut solver (Dinic, the default, and BK) against networkx on joint graphs."""
    sizes = [n for n in DEFAULT_SIZES if n <= args.max_nodes] or [args.max_nodes]
    rows = benchmark(sizes, args.networkx_limit_s, args.seed,
                     progress=lambda text: print(text, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(format_rows(rows, args.networkx_limit_s))
    return 0 if all(row["agree"] for row in rows) else 1


def median_seconds(solve: Callable[[], object], budget_s: float, max_repeats: int):
    """Median wall time of up to `max_repeats` calls (at least one) within about `budget_s`;
    returns (seconds, result of the last call)."""
    times = []
    started = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        result = solve()
        times.append(time.perf_counter() - t0)
        if len(times) >= max_repeats or time.perf_counter() - started > budget_s:
            return statistics.median(times), result


def networkx_flow_graph(net: SplitNetwork):
    """The network as a networkx DiGraph: parallel arcs merged (capacities add), self-loops
    dropped, integral capacities as Python ints (exact arithmetic in networkx), and +inf
    capacity as an edge without a 'capacity' attribute, which is how networkx spells it."""
    import networkx as nx

    merged: dict[tuple[int, int], float] = {}
    for u, v, c in zip(net.tails.tolist(), net.heads.tolist(), net.capacities.tolist()):
        if u != v:
            merged[(u, v)] = merged.get((u, v), 0.0) + c
    graph = nx.DiGraph()
    graph.add_nodes_from(range(net.num_nodes))
    for (u, v), c in merged.items():
        if math.isinf(c):
            graph.add_edge(u, v)
        else:
            graph.add_edge(u, v, capacity=int(c) if c.is_integer() else c)
    return graph


def networkx_min_cut_value(net: SplitNetwork, budget_s: float):
    """(seconds, cut value) of networkx.minimum_cut with its default flow function."""
    import networkx as nx

    graph = networkx_flow_graph(net)
    seconds, (value, _) = median_seconds(
        lambda: nx.minimum_cut(graph, net.source, net.sink), budget_s, max_repeats=3)
    return seconds, float(value)


def measure_size(num_nodes: int, seed: int, run_networkx: bool) -> dict:
    """One row for a joint graph of about `num_nodes` nodes: the median solve time of Dinic and
    Boykov-Kolmogorov, of networkx when `run_networkx`, and whether all cut values agree."""
    graph = joint_graph_with_about(num_nodes, seed)
    net = split_network(graph.node_costs, graph.edge_tails, graph.edge_heads,
                        graph.source_nodes, graph.sink_nodes)

    def solver(algorithm: str):
        return lambda: min_st_cut(net.num_nodes, net.tails, net.heads, net.capacities,
                                  net.source, net.sink, algorithm=algorithm)

    # Small graphs solve in milliseconds: repeat them for a stable median.
    ours_s, ours = median_seconds(solver("dinic"), budget_s=1.0, max_repeats=7)  # the default
    bk_s, bk = median_seconds(solver("boykov_kolmogorov"), budget_s=1.0, max_repeats=7)
    row = {
        "nodes": graph.num_nodes,
        "layers": graph.num_layers,
        "flow_nodes": net.num_nodes,
        "arcs": len(net.tails),
        "cut_value": ours.value,
        "ours_ms": ours_s * 1e3,
        "bk_ms": bk_s * 1e3,
        "networkx_ms": None,
        "ratio": None,
        "agree": ours.value == bk.value,
    }
    if run_networkx:
        networkx_s, networkx_value = networkx_min_cut_value(net, budget_s=2.0)
        row["networkx_ms"] = networkx_s * 1e3
        row["ratio"] = networkx_s / ours_s
        row["agree"] &= math.isclose(networkx_value, ours.value, rel_tol=1e-9)
    return row


def benchmark(sizes: Sequence[int], networkx_limit_s: float, seed: int = 0,
              progress: Optional[Callable[[str], None]] = None) -> list[dict]:
    """One measure_size row per size, in order. networkx is dropped from the first size where
    its last solve took, or is predicted to take, longer than networkx_limit_s."""
    rows: list[dict] = []
    networkx_on = True
    for size in sizes:
        if progress:
            progress(f"bench-solver: about {size} nodes ...")
        last = next((r for r in reversed(rows) if r["networkx_ms"] is not None), None)
        if networkx_on and last is not None:
            last_s = last["networkx_ms"] / 1e3
            # Linear extrapolation; the generator's arcs grow in proportion to its nodes.
            predicted_s = last_s * size / last["nodes"]
            networkx_on = last_s <= networkx_limit_s and predicted_s <= networkx_limit_s
        rows.append(measure_size(size, seed, networkx_on))
    return rows


def format_rows(rows: Sequence[dict], networkx_limit_s: float) -> str:
    """The rows as a text table, with a note on what each column means."""
    skipped = f"skipped (>{networkx_limit_s:g} s)"
    columns = [
        ("nodes", lambda r: f"{r['nodes']:,}"),
        ("arcs", lambda r: f"{r['arcs']:,}"),
        ("ours ms", lambda r: f"{r['ours_ms']:.2f}"),
        ("ours ns/arc", lambda r: f"{r['ours_ms'] * 1e6 / r['arcs']:.0f}"),
        ("bk ms", lambda r: f"{r['bk_ms']:.2f}"),
        ("networkx ms", lambda r: skipped if r["networkx_ms"] is None
         else f"{r['networkx_ms']:.1f}"),
        ("ratio", lambda r: "-" if r["ratio"] is None else f"{r['ratio']:.0f}x"),
        ("agree", lambda r: "yes" if r["agree"] else "NO"),
    ]
    note = ("nodes: joint-graph nodes (the flow network has 2 * nodes + 2); arcs: flow-network "
            "arcs; ours: Dinic (the default); ours ns/arc: time per arc (flat = linear growth); "
            "bk: Boykov-Kolmogorov; ratio: networkx / ours; agree: all cut values equal")
    return format_table(rows, columns) + "\n" + note
