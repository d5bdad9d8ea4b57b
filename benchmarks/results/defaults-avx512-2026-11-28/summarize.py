"""The table of README "The defaults at training shapes (issue 41)", 2026-11-28: each cell's
step peak, median step s per round, CPU s, the ratio to fsdp2-block-compiled's step in the same
round, the first step (order-biased here: the peers of a cell share one inductor cache) and
collectives. Run: python summarize.py [FOLDER] (reads the r1-*/r2-* folders beside it, or in
FOLDER: ../defaults-fold-2026-11-28 holds the autocast cells after fold_reduce_casts)."""
import collections
import glob
import json
import os
import statistics
import sys

HERE = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
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
        cpu_ratios = [e["cpu_s"] / r["cpu_s"] for e, r in zip(es, ref)] if ref else []
        mb = es[0]["step_peak_bytes"] / 2**20
        print(f"{p:22} {mb:6.1f} MB  step {row([e['step_s'] for e in es], '%.3f')}"
              f"  cpu {row([e['cpu_s'] for e in es], '%.3f')}  x{row(ratios, '%.2f')}"
              f"  first {row([e['first_step_s'] for e in es], '%.1f')}"
              f"  colls {es[0]['collectives']}")
        if len(ratios) > 1:  # rounds of one cell: the medians of the per-round ratios
            print(f"{'':22} median over {len(ratios)} rounds: x{statistics.median(ratios):.3f}"
                  f" wall, x{statistics.median(cpu_ratios):.3f} CPU")
