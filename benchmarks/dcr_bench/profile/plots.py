"""PNGs (matplotlib, Agg): memory over one step per setup, with the forward/backward boundary
marked, one panel per backend x precision; a bar chart of the peaks (forward and backward
peaks side by side, overall = the taller); and, with `--budgets`, the budget trade: peak
against step time, one line per backend through its "ours@B" points, ours marked."""
from __future__ import annotations

import os
from typing import Optional

from dcr_bench.profile import results
from dcr_bench.profile.setups import BUDGET_SETUP, SETUPS

COLORS = {"unbucketed": "#7f7f7f", "baseline": "#d62728", "marking": "#1f77b4",
          "ours": "#2ca02c"}
BACKEND_COLORS = {"eager": "#1f77b4", "inductor": "#ff7f0e"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panels(rows: list, rank: int = 0) -> dict:
    panels: dict = {}
    for r in rows:
        if r["rank"] != rank:
            continue
        key = (r["world"], r["emulated"], r["backend"], r["precision"])
        panels.setdefault(key, {})[r["setup"]] = r
    return panels


def _title(key, several: bool) -> str:
    world, emulated, backend, precision = key
    t = f"{backend} + {precision}"
    if several:
        t += f" (world {world}{', emulated' if emulated else ''})"
    return t


def timelines(rows: list, path: str, title: str = "", rank: int = 0) -> Optional[str]:
    """memory_timeline.png at `path`: one panel per (world, backend, precision), each setup's
    memory over the step on `rank`. Returns the path, or None when there is nothing to plot."""
    panels = _panels(rows, rank)
    if not panels:
        return None
    plt = _plt()
    n = len(panels)
    cols = min(2, n)
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(7 * cols, 3.6 * nrows), squeeze=False)
    several = len({k[:2] for k in panels}) > 1
    scale, unit = results.unit_of(b for p in panels.values() for r in p.values()
                                 for b in r["timeline"]["bytes"])
    for ax, (key, by_setup) in zip(axes.flat, panels.items()):
        for setup in SETUPS:
            r = by_setup.get(setup)
            if r is None:
                continue
            tl = r["timeline"]
            ax.plot(tl["t_ms"], [b / scale for b in tl["bytes"]], color=COLORS[setup], lw=1.2,
                    label=f"{setup} (peak {r['peak_bytes'] / scale:.1f})", drawstyle="steps-post")
            ax.axvline(tl["fw_end_ms"], color=COLORS[setup], ls="--", lw=0.8)
        ax.set_title(_title(key, several), fontsize=10)
        ax.set_xlabel("time since step start (ms); dashed: forward ends")
        ax.set_ylabel(f"{unit} above step start")
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=9)
    return _save(plt, fig, path)


def peaks(folded: dict, path: str, title: str = "") -> Optional[str]:
    """Bar chart of the setups' forward and backward peaks per backend x precision (budget
    cells left out: budgets() plots them); None when no setup cell ran."""
    if not any(k[4] in SETUPS for k in folded):
        return None
    plt = _plt()
    import numpy as np

    groups = results.config_groups(folded)
    several = len({g[:2] for g in groups}) > 1
    biggest = max(c["peak_bytes"] for k, c in folded.items()
                  if k[4] in SETUPS)  # the budget cells have their own plot (and NaNs)
    scale, unit = results.unit_of([biggest])
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(groups)), 4))
    width = 0.8 / len(SETUPS)
    x = np.arange(len(groups))
    for i, setup in enumerate(SETUPS):
        fw = [folded.get((*g, setup), {}).get("fw_peak_bytes", 0) / scale for g in groups]
        bw = [folded.get((*g, setup), {}).get("bw_peak_bytes", 0) / scale for g in groups]
        pos = x - 0.4 + width * (i + 0.5)
        ax.bar(pos - width / 4, fw, width / 2, color=COLORS[setup], alpha=0.45,
               label=f"{setup}: forward")
        ax.bar(pos + width / 4, bw, width / 2, color=COLORS[setup], label=f"{setup}: backward")
        for p, f, b in zip(pos, fw, bw):
            ax.text(p, max(f, b), f"{max(f, b):.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [_title(g, several) for g in groups], fontsize=8)
    ax.set_ylabel(f"peak {unit} per rank above step start")
    ax.set_ylim(0, 1.35 * biggest / scale)  # room for the legend above the bars
    ax.legend(fontsize=7, ncol=3, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=9)
    return _save(plt, fig, path)


def _budget_panels(folded: dict) -> dict:
    """(world, precision) -> backend -> (ours' cell or None, [(budget, cell)]) for the timed
    (not emulated) groups with budget cells (results.budget_groups)."""
    panels: dict = {}
    for (world, emulated, backend, precision), ours, cells in results.budget_groups(folded):
        if not emulated:
            panels.setdefault((world, precision), {})[backend] = (
                ours, [(c["budget"], c) for _, c in cells])
    return panels


def budgets(folded: dict, path: str, title: str = "") -> Optional[str]:
    """The budget trade (`--budgets`): x step time, y peak memory per rank, one panel per
    precision, one line per backend through its feasible "ours@B" points (largest budget
    first, each labelled B), ours (the ordinary cut) a star. Infeasible budgets are named in
    the legend. None when no timed run has budget cells."""
    panels = _budget_panels(folded)
    if not panels:
        return None
    plt = _plt()
    scale, unit = results.unit_of(c["peak_bytes"] for c in folded.values())
    several = len({w for w, _ in panels}) > 1
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, ((world, precision), by_backend) in zip(axes.flat, sorted(panels.items())):
        for backend, (ours, points) in by_backend.items():
            color = BACKEND_COLORS.get(backend, "#333333")
            feasible = sorted(((b, c) for b, c in points if not c["infeasible"]),
                              key=lambda p: -p[0])
            infeasible = [b for b, c in points if c["infeasible"]]
            label = backend + (" (infeasible: " + ", ".join(f"{b:g}" for b in infeasible) + ")"
                               if infeasible else "")
            xs = [c["step_s"] for _, c in feasible]
            ys = [c["peak_bytes"] / scale for _, c in feasible]
            ax.plot(xs, ys, "o-", color=color, lw=1.4, label=label)
            for b, x, y in zip((b for b, _ in feasible), xs, ys):
                ax.annotate(f"{b:g}", (x, y), textcoords="offset points", xytext=(5, 4),
                            fontsize=8, color=color)
            if ours is not None:
                ax.plot([ours["step_s"]], [ours["peak_bytes"] / scale], "*", color=color,
                        ms=14, mec="black", mew=0.6, label=f"{backend}: {BUDGET_SETUP}")
        ax.set_title(f"{precision}" + (f" (world {world})" if several else "")
                     + ": peak vs step time per memory budget", fontsize=10)
        ax.set_xlabel("step time (s, median)")
        ax.set_ylabel(f"peak {unit} per rank above step start")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=9)
    return _save(plt, fig, path)


def _save(plt, fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(rows: list, folded: dict, out_dir: str, title: str = "") -> list:
    """The timeline, peaks and budgets plots into `out_dir`; returns the paths written."""
    made = [timelines(rows, os.path.join(out_dir, "memory_timeline.png"),
                      (title + "; " if title else "") + "rank 0"),
            peaks(folded, os.path.join(out_dir, "peaks.png"), title),
            budgets(folded, os.path.join(out_dir, "budgets.png"), title)]
    return [p for p in made if p]
