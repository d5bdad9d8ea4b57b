"""Each system's step against FSDP2 + per-block compile's, per round and over the rounds
(median of the per-round ratios), wall and CPU. Usage: python summarize.py [FOLDER]"""
import glob
import json
import os
import statistics
import sys

folder = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
ratios = {}
for path in sorted(glob.glob(os.path.join(folder, "r*", "results.json"))):
    rows = {e["peer"]: e for e in json.load(open(path))["folded"]}
    ref = rows["fsdp2-block-compiled"]
    line = [os.path.basename(os.path.dirname(path))]
    for peer, e in rows.items():
        wall, cpu = e["step_s"] / ref["step_s"], e["cpu_s"] / ref["cpu_s"]
        ratios.setdefault(peer, []).append((wall, cpu))
        line.append(f"{peer} {e['step_s']:.3f} s ({wall:.2f}x, CPU {cpu:.2f}x)")
    print("  ".join(line))
for peer, rs in ratios.items():
    print(f"median over {len(rs)} rounds: {peer} {statistics.median(r[0] for r in rs):.3f}x "
          f"wall, {statistics.median(r[1] for r in rs):.3f}x CPU")
