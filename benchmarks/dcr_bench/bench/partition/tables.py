"""bench-partition's text output: the depth sweep, the end-to-end rows and the compile shares as
fixed-width tables (the depth sweep's printed a line at a time as each depth finishes)."""
from __future__ import annotations

from dcr_bench.bench.partition.depth_sweep import PartitionRow
from dcr_bench.bench.partition.speed import SpeedRow


def format_depth_sweep(rows: list[PartitionRow]) -> str:
    """The rows as a fixed-width text table, one line per model depth."""
    head = (f"{'layers':>6} {'nodes':>7} {'ours ms':>9} {'torch ms':>10} {'speedup':>8} "
            f"{'decide ours':>12} {'decide torch':>13} {'speedup':>8} "
            f"{'ours saved MB':>14} {'torch saved MB':>15} {'ours act MB':>12} "
            f"{'torch act MB':>13} {'CI recomp ours/torch':>21}")
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.layers:>6} {r.nodes:>7} {r.ours_ms:>9.1f} {r.torch_ms:>10.1f} {r.speedup:>7.1f}x "
            f"{r.ours_decide_ms:>12.1f} {r.torch_decide_ms:>13.1f} {r.decide_speedup:>7.1f}x "
            f"{r.ours_saved_bytes / 2**20:>14.2f} {r.torch_saved_bytes / 2**20:>15.2f} "
            f"{r.ours_activation_bytes / 2**20:>12.2f} {r.torch_activation_bytes / 2**20:>13.2f} "
            f"{r.ours_recomputed_compute_intensive:>10}/{r.torch_recomputed_compute_intensive:<10}")
    return "\n".join(lines)


def format_speed(rows: list[SpeedRow]) -> str:
    """One line per graph and partitioner: median ms, torch's over it, our phases, spread."""
    lines = [f"{'graph':<8} {'partitioner':<12} {'nodes':>6} {'ms':>8} {'vs torch':>9} "
             f"{'prepare':>8} {'export':>7} {'solve':>6} {'extract':>8} "
             f"{'(place':>7} {'order':>6} {'build)':>7}  {'spread ms':<14} path"]
    for r in rows:
        split = (f"{r.place_ms:>7.1f} {r.order_ms:>6.1f} {r.build_ms:>7.1f}"
                 if r.extract_path == "ours" else f"{'':>7} {'':>6} {'':>7}")
        phases = (f"{r.prepare_ms:>8.1f} {r.export_ms:>7.1f} {r.solve_ms:>6.1f} "
                  f"{r.extract_ms:>8.1f} {split}"
                  if r.partitioner != "torch" else f"{'':>8} {'':>7} {'':>6} {'':>8} {split}")
        lines.append(f"{r.graph:<8} {r.partitioner:<12} {r.nodes:>6} {r.ms:>8.1f} "
                     f"{r.vs_torch:>8.2f}x {phases}  "
                     f"{f'{r.spread_ms[0]}-{r.spread_ms[1]}':<14} {r.extract_path}")
    return "\n".join(lines)


def format_share(rows: list[dict]) -> str:
    """One line per graph and backend: partition ms / compile ms (share), before and after."""
    lines = [f"{'graph':<9} {'backend':<9} {'before: partition / compile':>30} "
             f"{'after: partition / compile':>30}"]
    for r in rows:
        cells = [f"{r[k]['partition_ms']:>8.0f} / {r[k]['compile_ms']:>7.0f} ms "
                 f"({r[k]['share']:>4.0%})" for k in ("before", "after")]
        lines.append(f"{r['graph']:<9} {r['backend']:<9} {cells[0]:>30} {cells[1]:>30}")
    return "\n".join(lines)
