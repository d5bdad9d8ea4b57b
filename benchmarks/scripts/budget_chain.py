"""Seed 004 (Chen et al., sublinear memory) on a chain, through the budget sweep.

For chains of n identical layers h_i = relu(h_{i-1} @ W_i^T), traced with AOTAutograd and
exported as the partitioner would, the budget sweep (partition/budget.py) gives the cuts on
the lower hull of (saved bytes, recompute cost). For every budget (one activation apart) whose
decision recomputes at most one forward, this script simulates the backward's peak activation
memory: the saved values, plus each recomputed value from just before its first backward use
to its last, plus the backward's own temporaries (gradients of activations); parameters and
the parameter gradients (the backward's outputs, the same at every budget) are left out. The
smallest peak over the budgets should grow like sqrt(n); the script fits the exponent.

Why the peak and not the saved bytes: the cut model recomputes each node once, so at one
extra forward the fewest saved bytes are O(1) (the input alone); what that costs is residency,
every recomputed activation alive at once in the backward. Checkpoints spread evenly by the
budget walk (budget_cut.h) trade the two: k checkpoints leave segments of n/k recomputed
values, peak ~ k + n/k, smallest at k ~ sqrt(n).

Result (CPU, torch 2.13; units: one activation; BATCH=4, WIDTH=8):
      n  default peak  best saved  best peak  cost (forwards)
     16            20           5         11             0.75
     64            68           9         19             0.88
    256           260          17         35             0.94
best peak = 2 sqrt(n) + 3 exactly; fitted exponent 0.417 raw, 0.500 after removing the
backward's 3 activations of gradient temporaries (the same at every budget).

    PYTHONPATH=. python3 benchmarks/scripts/budget_chain.py [--sizes 16 64 256]
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from deepcompile_remat import _C
from deepcompile_remat.partition import budget
from deepcompile_remat.partition.op_classes import OpClass

_TANGENT_CLOSURE = int(_C.NodeInfoBit.TANGENT_CLOSURE)
BATCH, WIDTH = 4, 8


def chain(x, *weights):
    """n identical layers: linear (no bias) then relu."""
    h = x
    for w in weights:
        h = torch.relu(h @ w.t())
    return h


def trace_chain(n: int):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(BATCH, WIDTH, generator=g, requires_grad=True)
    ws = [torch.randn(WIDTH, WIDTH, generator=g, requires_grad=True) for _ in range(n)]
    return budget.trace_joint_graph(chain, [x, *ws], parameter_indices=range(1, n + 1))


def backward_peak(graph, sweep: budget.BudgetSweep, point: budget.BudgetPoint) -> float:
    """Peak live bytes of the backward under `point` (see the module docstring)."""
    n = len(graph.nodes)
    info = sweep.node_info
    producers = [[] for _ in range(n)]
    for t, h in zip(graph.edge_tails, graph.edge_heads):
        producers[h].append(int(t))
    is_view = graph.op_class == int(OpClass.VIEW)  # a uint8 array: compare with the int
    root = list(range(n))
    for v in range(n):  # views share their base's storage
        if is_view[v] and producers[v]:
            root[v] = root[producers[v][0]]
    size = np.where(is_view, 0.0, sweep.save_bytes)  # static inputs (parameters) count 0
    size = np.where(np.isfinite(size), size, 0.0)
    outputs = set(graph.bwd_outputs.tolist())
    recomputed = set(point.recomputed_ids.tolist())
    saved = set(point.saved_ids.tolist())
    # Backward order: tangent-closure nodes in FX order, each preceded by the recomputed
    # values it needs that are not there yet (producers first).
    order, done = [], set()

    def ensure(v):
        if v in done or v not in recomputed:
            return
        for p in producers[v]:
            ensure(p)
        done.add(v)
        order.append(v)

    for v in range(n):
        if info[v] & _TANGENT_CLOSURE:
            for p in producers[v]:
                ensure(p)
            order.append(v)
    last_use = {}
    for step, v in enumerate(order):
        for p in producers[v]:
            last_use[root[p]] = step
    live = {root[v] for v in saved}
    live |= {root[v] for v in range(n) if info[v] & _TANGENT_CLOSURE
             and graph.nodes[v].op == "placeholder"}
    counted = lambda r: 0.0 if r in outputs else size[r]  # noqa: E731
    current = sum(counted(r) for r in live)
    peak = current
    for step, v in enumerate(order):
        r = root[v]
        if r not in live:
            live.add(r)
            current += counted(r)
        peak = max(peak, current)
        for p in {root[p] for p in producers[v]} | {r}:
            if p in live and last_use.get(p, -1) <= step and p not in outputs:
                live.discard(p)
                current -= counted(p)
    return peak


def study(n: int) -> dict:
    t0 = time.perf_counter()
    graph = trace_chain(n)
    sweep = budget.BudgetSweep(graph)
    act = BATCH * WIDTH * 4
    hull = sweep.hull()
    one_forward = sweep.one_forward_cost
    default = hull[-1]  # the high end: what choose() gives at or above its bytes
    best = None
    for b in np.arange(hull[0].saved_bytes, hull[-1].saved_bytes + act, act):
        d = sweep.choose(b)
        if d.point.recompute_cost > one_forward:
            continue
        peak = backward_peak(graph, sweep, d.point)
        if best is None or peak < best[0]:
            best = (peak, d)
    peak, d = best
    return dict(n=n, hull_vertices=len(hull), default_saved=default.saved_bytes / act,
                default_peak=backward_peak(graph, sweep, default) / act,
                min_saved=hull[0].saved_bytes / act,
                min_saved_peak=backward_peak(graph, sweep, hull[0]) / act,
                best_saved=d.point.saved_bytes / act, best_peak=peak / act,
                best_cost=d.point.recompute_cost / one_forward, gap=d.optimality_gap / one_forward,
                seconds=time.perf_counter() - t0)


def fit_exponent(ns, ys) -> float:
    """Least-squares slope of log y over log n."""
    return float(np.polyfit(np.log(ns), np.log(ys), 1)[0])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256])
    args = ap.parse_args(argv)
    rows = [study(n) for n in args.sizes]
    print("units: one activation (%d bytes); cost: in forwards" % (BATCH * WIDTH * 4))
    print(f"{'n':>5} {'hull':>5} {'default saved':>13} {'default peak':>12} {'min saved':>9} "
          f"{'its peak':>8} {'best saved':>10} {'best peak':>9} {'cost':>6} {'2sqrt(n)':>8} {'s':>6}")
    for r in rows:
        print(f"{r['n']:>5} {r['hull_vertices']:>5} {r['default_saved']:>13.0f} "
              f"{r['default_peak']:>12.0f} {r['min_saved']:>9.0f} {r['min_saved_peak']:>8.0f} "
              f"{r['best_saved']:>10.0f} {r['best_peak']:>9.0f} {r['best_cost']:>6.2f} "
              f"{2 * math.sqrt(r['n']):>8.1f} {r['seconds']:>6.1f}")
    ns = [r["n"] for r in rows]
    print("exponent of the best peak over n: %.3f" % fit_exponent(ns, [r["best_peak"] for r in rows]))
    print("exponent of the default peak over n: %.3f"
          % fit_exponent(ns, [r["default_peak"] for r in rows]))
    # The backward's own temporaries (gradient buffers) add the same few activations at every
    # budget: measured as the default cut's peak minus what it saves.
    overhead = [float(r["default_peak"] - r["default_saved"]) for r in rows]
    print("backward temporaries (default peak - default saved): %s activations" % overhead)
    print("exponent of (best peak - temporaries) over n: %.3f"
          % fit_exponent(ns, [r["best_peak"] - o for r, o in zip(rows, overhead)]))
    return rows


if __name__ == "__main__":
    main()
