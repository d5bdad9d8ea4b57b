"""The autocast cells of README "The defaults at training shapes (issue 41)" after
fold_reduce_casts (2026-11-28, a later session; the same columns as defaults-avx512): each cell's
step peak, median step s per round, CPU s, the ratio to fsdp2-block-compiled's step in the same
round, the first step (order-biased here: the peers of a cell share one inductor cache) and
collectives. Run: python summarize.py (reads the r1-*/r2-* folders beside it)."""
import collections
import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
cells = collections.defaultdict(dict)
for f in sorted(glob.glob(os.path.join(HERE, "r*-*", "results.json"))):
    _, cell = os.path.basename(os.path.dirname(f)).split("-", 1)
    for e in json.load(open(f))["folded"]:
        cells[cell].setdefault(e["peer"], []).append(e)


def row(values, fmt):
    return " ".join(fmt % v for v in values)


for cell, peers in cells.items():
    ref = peers.get("fsdp2-block-compiled")
    print(f"== {cell}")
    for p, es in peers.items():
        ratios = [e["step_s"] / r["step_s"] for e, r in zip(es, ref)] if ref else []
        mb = es[0]["step_peak_bytes"] / 2**20
        print(f"{p:22} {mb:6.1f} MB  step {row([e['step_s'] for e in es], '%.3f')}"
              f"  cpu {row([e['cpu_s'] for e in es], '%.3f')}  x{row(ratios, '%.2f')}"
              f"  first {row([e['first_step_s'] for e in es], '%.1f')}"
              f"  colls {es[0]['collectives']}")
