"""PNGs (matplotlib, Agg): memory_timeline.png, one cell's memory over one training step told
as a story (forward, backward, gradients released; what the forward keeps for the backward;
where each setup peaks); a bar chart of the peaks (forward and backward peaks side by side,
overall = the taller); and, with `--budgets`, the budget trade: peak against step time, one
line per backend through its "ours@B" points, ours marked."""
from __future__ import annotations

import math
import os
from typing import Optional

from dcr_bench.profile import results
from dcr_bench.profile.setups import BUDGET_SETUP, SETUP_HELP, SETUPS

COLORS = {"unbucketed": "#7f7f7f", "baseline": "#d62728", "regather": "#1f77b4",
          "ours": "#2ca02c"}
BACKEND_COLORS = {"eager": "#1f77b4", "inductor": "#ff7f0e"}
# The timeline: the two setups the story compares drawn bold, the others thin and dashed.
LINE_STYLES = {"unbucketed": {"lw": 1.0, "ls": ":"}, "baseline": {"lw": 2.2, "ls": "-"},
               "regather": {"lw": 1.2, "ls": "--"}, "ours": {"lw": 2.2, "ls": "-"}}
# Phases of a step on the timeline's x axis: (name, width, shade). Forward and backward get
# the same width whatever they took; releasing the gradients is a moment.
PHASES = (("forward", 1.0, "#e8f0fa"), ("backward", 1.0, "#fbeee0"),
          ("grads\nfreed", 0.15, "#e4e4e4"))
BINS_PER_UNIT = 50  # the line is the highest memory in each 2% of a phase
END_SLIVER = 0.02  # x width of the step's end state after the last bin
# The setups the timeline tells: unbucketed holds what baseline holds (it differs in how many
# collectives it issues, which the table shows).
TOLD = ("baseline", "regather", "ours")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(key, several: bool) -> str:
    world, emulated, backend, precision = key
    t = f"{backend} + {precision}"
    if several:
        t += f" (world {world}{', emulated' if emulated else ''})"
    return t


def timeline_cell(rows: list, rank: int = 0) -> Optional[tuple]:
    """The (world, emulated, backend, precision) memory_timeline.png tells: the first one run,
    preferring one where both baseline and ours ran (the comparison the story is about)."""
    groups: dict = {}
    for r in rows:
        if r["rank"] == rank and r["setup"] in SETUPS and r["timeline"]["t_ms"]:
            groups.setdefault((r["world"], r["emulated"], r["backend"], r["precision"]),
                              set()).add(r["setup"])
    both = [k for k, setups in groups.items() if {"baseline", "ours"} <= setups]
    return (both or list(groups) or [None])[0]


def phase_edges(timeline: dict) -> tuple[float, float, float]:
    """(forward end, backward end, step end) in ms of a row's timeline; a timeline without the
    backward's end (older results.json) gets a release of zero length."""
    fw, end = timeline["fw_end_ms"], timeline["step_end_ms"]
    bw = timeline.get("release_ms", float("nan"))
    return fw, (end if bw is None or math.isnan(bw) else bw), end


def phase_progress(t_ms, timeline: dict):
    """Each time of the step mapped onto the phases' shared axis: the forward onto [0, 1], the
    backward onto [1, 2], the release onto [2, 2 + its width] (PHASES), linearly within each."""
    import numpy as np

    fw, bw, end = phase_edges(timeline)
    xs, x0 = [0.0], 0.0
    for _, width, _ in PHASES:
        x0 += width
        xs.append(x0)
    return np.interp(np.asarray(t_ms, dtype=float), [0.0, fw, bw, max(end, bw + 1e-9)], xs)


def high_water(x, y, width: float):
    """(bin edges, highest y in each bin) of the step function y(x) (each value holds until the
    next), bins of BINS_PER_UNIT per unit of x over [0, width]: every peak survives, the
    jitter of short-lived buffers does not hide the shape."""
    import numpy as np

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    n = max(1, int(round(width * BINS_PER_UNIT)))
    edges = np.linspace(0.0, width, n + 1)
    # The value holding when a bin opens, then the largest event inside it.
    held = y[np.clip(np.searchsorted(x, edges[:-1], side="right") - 1, 0, len(y) - 1)]
    inside = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, n - 1)
    top = held.copy()
    np.maximum.at(top, inside, y)
    return edges, top


def timelines(rows: list, path: str, title: str = "", rank: int = 0,
              parameters: Optional[int] = None) -> Optional[str]:
    """memory_timeline.png at `path` (timeline_figure); returns the path, or None when there
    is nothing to plot."""
    fig = timeline_figure(rows, title, rank, parameters)
    if fig is None:
        return None
    return _save(_plt(), fig, path, tight=False)


def timeline_figure(rows: list, title: str = "", rank: int = 0,
                    parameters: Optional[int] = None):
    """The figure of memory_timeline.png, or None: one cell (timeline_cell) on `rank`, the allocated memory
    of baseline, regather and ours over one training step. The phases are shaded and named,
    each setup's forward and backward stretched to the same width (real durations in the
    legend). Per setup, a line of the highest memory in each 2% of a phase and, lighter, the
    band down to the lowest (what is held throughout; the band is what comes and goes: a
    gathered weight in use, temporaries). What the forward hands the backward and each peak
    are annotated, flat stretches explained below. With `parameters`, the gradient shards
    held at the backward's end are annotated."""
    import textwrap

    import numpy as np

    key = timeline_cell(rows, rank)
    if key is None:
        return None
    by_setup = {r["setup"]: r for r in rows if r["rank"] == rank and r["setup"] in TOLD
                and (r["world"], r["emulated"], r["backend"], r["precision"]) == key}
    plt = _plt()
    scale, unit = results.unit_of(b for r in by_setup.values() for b in r["timeline"]["bytes"])
    fig = plt.figure(figsize=(13, 7.8))
    ax = fig.add_axes([0.07, 0.25, 0.55, 0.64])
    total = sum(w for _, w, _ in PHASES)
    top = max(r["peak_bytes"] for r in by_setup.values()) / scale
    x0 = 0.0
    for name, width, shade in PHASES:
        ax.axvspan(x0, x0 + width, color=shade, zorder=0)
        ax.text(x0 + width / 2, 1.36 * top, name, ha="center", va="top",
                fontsize=11 if width >= 1 else 8, fontweight="bold", color="#444444")
        x0 += width
    ax.axvline(1.0, color="black", lw=0.8, zorder=1)
    ax.axhline(0.0, color="black", lw=0.6, zorder=1)
    handles = []
    for setup in TOLD:
        r = by_setup.get(setup)
        if r is None:
            continue
        tl = r["timeline"]
        fw, bw, _ = phase_edges(tl)
        x = phase_progress(tl["t_ms"], tl)
        edges, high = high_water(x, tl["bytes"], total)
        _, low = high_water(x, [-b for b in tl["bytes"]], total)
        # A last sliver holds what is left when the step ends (the release frees everything
        # within its final bin, whose highest value would otherwise end the line).
        edges = np.append(edges, total + END_SLIVER)
        high, low = np.append(high, tl["bytes"][-1]), np.append(low, -tl["bytes"][-1])
        color = COLORS[setup]
        ax.stairs(high / scale, edges, baseline=-low / scale, fill=True, color=color,
                  alpha=0.2, lw=0, zorder=2)
        line = ax.stairs(high / scale, edges, baseline=None, color=color, zorder=3,
                         **LINE_STYLES[setup])
        i = int(high.argmax())
        ax.plot([(edges[i] + edges[i + 1]) / 2], [high[i] / scale], "v", color=color, ms=9,
                mec="black", mew=0.5, zorder=4)
        line.set_label("\n".join(textwrap.wrap(
            f"{setup}: {SETUP_HELP[setup]}. Peak {r['peak_bytes'] / scale:.1f} {unit}; "
            f"forward {fw:.0f} ms, backward {bw - fw:.0f} ms", 58)))
        handles.append(line)
    _annotate_boundary(ax, by_setup, scale, unit, top)
    if parameters and key[0]:
        _annotate_gradients(ax, by_setup, key, parameters, scale, unit, top)
    ax.set_xlim(0, total + END_SLIVER)
    ax.set_ylim(-0.3 * top, 1.4 * top)
    ax.set_yticks([t for t in ax.get_yticks() if 0 <= t <= 1.2 * top])  # below 0: annotations
    ax.set_xticks([0, 1, 2], ["step starts", "forward ends", "backward ends"])
    ax.set_xlabel("progress through one training step (each setup's phases stretched to line up)")
    ax.set_ylabel(f"allocated memory above the step's start ({unit}, rank {rank})")
    ax.grid(axis="y", alpha=0.3)
    where = f"{key[0]} ranks" + (", emulated" if key[1] else "") if key[0] else "emulated"
    fig.suptitle(f"Memory over one training step: {_title(key, False)}, {where}"
                 + (f"\n{title}" if title else ""), fontsize=12)
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.635, 0.91), fontsize=9,
               frameon=False, title="setups (line: highest memory; band: down to the lowest)",
               title_fontsize=9, alignment="left", labelspacing=1.2)
    notes = [
        "How to read it. A step here is forward, backward and releasing the gradients (no "
        "optimizer step: `deepcompile-remat compare` measures whole steps). The line is the "
        "highest memory in each 2% of a phase, the band reaches down to the lowest: the "
        "bottom of the band is what stays held, the band itself what comes and goes (a "
        "gathered weight while it is used, temporaries). \u25bc marks each setup's peak.",
        "Flat stretches: no tensor is allocated or freed, i.e. the rank computes, or waits in "
        "a collective (a gloo gather or reduce-scatter on CPU).",
        "What differs: torch's partitioner (baseline) keeps every gathered weight from the "
        "forward for the backward, so its memory climbs through the forward; ours keeps none "
        "and gathers each weight again in the backward.",
    ]
    fig.text(0.07, 0.03, "\n".join(textwrap.fill(n, 150) for n in notes), fontsize=9,
             va="bottom", color="#222222")
    return fig


def _annotate_boundary(ax, by_setup: dict, scale: float, unit: str, top: float) -> None:
    """At the forward's end: what baseline and ours keep for the backward, and how much of
    it is gathered weights."""
    for setup, (tx, ty) in (("baseline", (0.05, 1.13 * top)), ("ours", (1.08, -0.17 * top))):
        r = by_setup.get(setup)
        if r is None:
            continue
        kept, weights = r["boundary_bytes"] / scale, r["saved_weight_bytes"] / scale
        what = (f"{weights:.1f} {unit} of it gathered weights" if weights > 0
                else "no gathered weight")
        ax.annotate(f"{setup} keeps {kept:.1f} {unit} for the backward\n({what})",
                    xy=(1.0, kept), xytext=(tx, ty), fontsize=9, color=COLORS[setup],
                    fontweight="bold", zorder=6, va="center",
                    arrowprops={"arrowstyle": "->", "color": COLORS[setup], "lw": 1.3},
                    bbox={"facecolor": "white", "alpha": 0.9, "edgecolor": "none"})


def _annotate_gradients(ax, by_setup: dict, key: tuple, parameters: int, scale: float,
                        unit: str, top: float) -> None:
    """At the backward's end: the gradient shards every setup holds until they are released
    (fp32 under autocast, bf16 with bf16 parameters; 1/world of every parameter)."""
    world, _, _, precision = key
    grads = (4 if precision == "autocast" else 2) * parameters / world / scale
    kind = "fp32" if precision == "autocast" else "bf16"
    ax.annotate(f"gradient shards ({kind}, 1/{world} of each\nparameter): ~{grads:.1f} {unit}, "
                "held until released", xy=(2.0, grads), xytext=(1.2, 1.13 * top), fontsize=9,
                color="#333333", zorder=6, va="center",
                arrowprops={"arrowstyle": "->", "color": "#333333", "lw": 1.0},
                bbox={"facecolor": "white", "alpha": 0.9, "edgecolor": "none"})


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


def _save(plt, fig, path: str, tight: bool = True) -> str:
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(rows: list, folded: dict, out_dir: str, title: str = "",
              parameters: Optional[int] = None) -> list:
    """The timeline, peaks and budgets plots into `out_dir`; returns the paths written.
    parameters: the model's parameter count (the timeline annotates the gradient shards)."""
    made = [timelines(rows, os.path.join(out_dir, "memory_timeline.png"), title,
                      parameters=parameters),
            peaks(folded, os.path.join(out_dir, "peaks.png"), title),
            budgets(folded, os.path.join(out_dir, "budgets.png"), title)]
    return [p for p in made if p]
