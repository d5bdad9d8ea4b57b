"""The profile's results: the rows folded into cells; the table in DeepSpeed PR #7609's layout
(every setup's time and memory, delta of ours against the baseline), a detail table per
cell, the budget table (`--budgets`: per "ours@B" cell what budget mode decided, its peak and
step time beside ours'), a footer (definitions, the activation formula of Korthikanti et al.
beside the baseline's measured saved activations), results.json and results.csv.

Per-rank figures are folded into one per cell: memory is the largest over ranks (the rank that
runs out first), time the slowest rank's median. results.json keeps every rank.
"""
from __future__ import annotations

import csv
import json
import math
from typing import Iterable, Optional

from dcr_bench.profile.setups import (
    BUDGET_HELP,
    BUDGET_SETUP,
    PRECISION_HELP,
    SETUP_HELP,
    SETUPS,
    is_budget_label,
)

# What a budget cell records besides the measured figures (measure.budget_figures); rows of
# other cells carry them too, None but infeasible=False. Per step: summed over its graphs.
BUDGET_FIELDS = ("budget", "budget_bytes", "budget_default_saved_bytes", "budget_saved_bytes",
                 "recompute_flops", "optimality_gap_flops", "budget_graphs", "infeasible",
                 "min_budget_bytes")

STEP_DEFINITION = (
    "step = forward (compiled model + fp32 cross-entropy) + backward (compiled backward, "
    "gradient shards reduce-scattered into .grad) + grads released (set to None); no optimizer. "
    "Peaks are above the allocator's total at the step's start (sharded model and inputs "
    "allocated), from the profiled steps after the timed ones (each rank: the step with the "
    "smallest peak); time is the median of the timed steps after warm-up.")


def korthikanti_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int,
                                dropout: bool = False) -> float:
    """Activation bytes one transformer layer keeps for the backward with 16-bit activations
    (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    section 4): attention 11sbh + 5as^2b, MLP 19sbh, two layer norms
    4sbh, i.e. sbh(34 + 5as/h). Without dropout the three masks go (sbh + sbh + as^2b) and
    attention-over-values reads the softmax output that the softmax backward keeps anyway
    (2as^2b fewer): sbh(32 + 2as/h)."""
    s, b, h, a = seq, batch, hidden, heads
    if dropout:
        return s * b * h * (34 + 5 * a * s / h)
    return s * b * h * (32 + 2 * a * s / h)


def fold(rows: Iterable[dict]) -> dict:
    """(world, emulated, backend, precision, setup) -> the cell's figures over its ranks."""
    cells: dict = {}
    for r in rows:
        key = (r["world"], r["emulated"], r["backend"], r["precision"], r["setup"])
        cells.setdefault(key, []).append(r)
    out = {}
    for key, rs in cells.items():
        peak = [r["peak_bytes"] for r in rs]
        out[key] = {
            "ranks": len(rs),
            "peak_bytes": max(peak), "peak_spread_bytes": max(peak) - min(peak),
            "fw_peak_bytes": max(r["fw_peak_bytes"] for r in rs),
            "bw_peak_bytes": max(r["bw_peak_bytes"] for r in rs),
            "boundary_bytes": max(r["boundary_bytes"] for r in rs),
            "step_s": max(r["step_s"] for r in rs),
            "compile_s": max(r["compile_s"] for r in rs),
            "predicted_peak_bytes": max(r["predicted_peak_bytes"] for r in rs),
            "saved_bytes": max(r["saved_bytes"] for r in rs),
            "saved_weight_bytes": max(r["saved_weight_bytes"] for r in rs),
            "saved_activation_bytes": max(r["saved_activation_bytes"] for r in rs),
            "activation_bytes_per_block": _mean_per_block(rs[0]),
            "gathered_bytes": max(r["gathered_bytes"] for r in rs),
            "exact_counter": all(r.get("exact_counter", True) for r in rs),
            "device": rs[0]["device"],
            # Budget mode decides alike on every rank (the same graphs): rank 0's figures.
            **{f: rs[0].get(f) for f in BUDGET_FIELDS},
            "infeasible": any(r.get("infeasible", False) for r in rs),
        }
    return out


def _mean_per_block(row: dict) -> float:
    per = row.get("activation_bytes_per_block") or {}
    return sum(per.values()) / len(per) if per else float("nan")


def unit_of(values: Iterable[float]) -> tuple[float, str]:
    """(scale, name) to print these byte counts in: GB from 4 GB up, else MB."""
    biggest = max([abs(v) for v in values if not math.isnan(v)] or [0.0])
    return (2**30, "GB") if biggest >= 4 * 2**30 else (2**20, "MB")


def _delta(new: float, old: float) -> str:
    if not old or math.isnan(old) or math.isnan(new):
        return "n/a"
    return f"{100.0 * (new - old) / old:+.1f}%"


def config_groups(folded: dict) -> list:
    """The (world, emulated, backend, precision) of the folded cells, in first-seen order."""
    seen = []
    for (world, emulated, backend, precision, _setup) in folded:
        g = (world, emulated, backend, precision)
        if g not in seen:
            seen.append(g)
    return seen


DELTA_MEANING = ("delta = (ours - baseline) / baseline: ours' relative change against torch's "
                 "partitioner with the same collective buckets; negative = less time or memory "
                 "than the baseline; lower is better")


def main_table(folded: dict) -> str:
    """#7609's layout: per backend+precision, every setup's time and memory, and the delta of
    ours against the baseline (DELTA_MEANING, printed under the table with what each setup
    is)."""
    scale, unit = unit_of(c["peak_bytes"] for c in folded.values())
    setups = [s for s in SETUPS if any(k[4] == s for k in folded)]
    w = {s: max(8, len(s)) for s in setups}
    head = " ".join(f"{s:>{w[s]}}" for s in setups)
    width = len(head) + 8
    memory_title = f"peak memory per rank ({unit})"
    lines = [f"{'':<24} {'step time (s)':^{width}}   {memory_title:^{width}}",
             f"{'backend+precision':<24} {head} {'delta':>7}   {head} {'delta':>7}"]
    for world, emulated, backend, precision in config_groups(folded):
        get = {s: folded.get((world, emulated, backend, precision, s)) for s in setups}
        times = " ".join(f"{get[s]['step_s']:>{w[s]}.3f}"
                         if get[s] and not math.isnan(get[s]["step_s"]) else f"{'-':>{w[s]}}"
                         for s in setups)
        mems = " ".join(f"{get[s]['peak_bytes'] / scale:>{w[s]}.2f}" if get[s]
                        else f"{'-':>{w[s]}}" for s in setups)
        base, ours = get.get("baseline"), get.get("ours")
        dt = _delta(ours["step_s"], base["step_s"]) if base and ours else "n/a"
        dm = _delta(ours["peak_bytes"], base["peak_bytes"]) if base and ours else "n/a"
        name = f"{backend}+{precision}" + (f" (w{world}{', emulated' if emulated else ''})"
                                          if _several_worlds(folded) else "")
        lines.append(f"{name:<24} {times} {dt:>7}   {mems} {dm:>7}")
    lines.append(DELTA_MEANING + ".")
    lines.append("setups:")
    lines += [f"  {s:<11} {SETUP_HELP[s]}" for s in setups]
    return "\n".join(lines)


def _several_worlds(folded: dict) -> bool:
    return len({(k[0], k[1]) for k in folded}) > 1


def _ranks_differ(cell: dict) -> bool:
    return cell["peak_spread_bytes"] > 0.02 * max(cell["peak_bytes"], 1.0)


def detail_table(folded: dict) -> str:
    """Per cell: peaks, what crosses to the backward, the prediction, bytes gathered."""
    scale, unit = unit_of(c["peak_bytes"] for c in folded.values())
    cols = (f"{'cell':<34} {'peak':>8} {'fw peak':>8} {'bw peak':>8} {'fw end':>8} "
            f"{'predict':>8} {'saved':>8} {'weights':>8} {'gathered':>9} {'compile s':>9}")
    lines = [f"per cell, {unit}, max over ranks. fw end: alive when the forward ends; predict: "
             "memory simulator on the partitioned FX graphs; saved: fw->bw bytes the partition "
             "chose, weights: of which gathered weights; gathered: allgather bytes received "
             "per step", cols]
    for (world, emulated, backend, precision, setup), c in folded.items():
        name = f"{backend}/{precision}/{setup}" + (f" w{world}{'e' if emulated else ''}"
                                                   if _several_worlds(folded) else "")
        if c["infeasible"]:
            lines.append(f"{name:<34} {infeasible_text(c, scale, unit)}")
            continue
        spread = "*" if _ranks_differ(c) else " "
        lines.append(
            f"{name:<34} {c['peak_bytes'] / scale:>7.2f}{spread} "
            f"{c['fw_peak_bytes'] / scale:>8.2f} "
            f"{c['bw_peak_bytes'] / scale:>8.2f} {c['boundary_bytes'] / scale:>8.2f} "
            f"{c['predicted_peak_bytes'] / scale:>8.2f} "
            f"{c['saved_bytes'] / scale:>8.2f} {c['saved_weight_bytes'] / scale:>8.2f} "
            f"{c['gathered_bytes'] / scale:>9.2f} {c['compile_s']:>9.1f}")
    if any(_ranks_differ(c) for c in folded.values()):
        lines.append("* ranks differ by more than 2% (results.json has each rank)")
    return "\n".join(lines)


def infeasible_text(cell: dict, scale: float, unit: str) -> str:
    """What the tables print for a budget below the smallest legal cut."""
    least = cell["min_budget_bytes"]
    if least / scale >= 0.01:
        return f"infeasible (min {least / scale:.2f} {unit})"
    return f"infeasible (min {least:.0f} bytes)"


def budget_groups(folded: dict) -> list:
    """Per config group with budget cells: (group, ours' cell or None, [(setup, cell)] in run
    order)."""
    out = []
    for g in config_groups(folded):
        cells = [(k[4], c) for k, c in folded.items() if k[:4] == g and is_budget_label(k[4])]
        if cells:
            out.append((g, folded.get((*g, BUDGET_SETUP)), cells))
    return out


def budget_table(folded: dict) -> str:
    """`--budgets`: per backend+precision, ours (the ordinary cut) and each "ours@B" cell:
    the budget and the saved bytes budget mode chose (ours: the ordinary cut's), the flops the
    backward recomputes and how far that may be from the best, the measured peak and step
    time with their change against ours, and what is alive when the forward ends (where the
    saved bytes show; the peak may sit elsewhere). Empty when the run had no budget cells."""
    groups = budget_groups(folded)
    if not groups:
        return ""
    scale, unit = unit_of([c["peak_bytes"] for c in folded.values()]
                          + [c["budget_default_saved_bytes"] or 0.0 for c in folded.values()])
    flops = [c["recompute_flops"] or 0.0 for c in folded.values()]
    fscale, funit = (1e9, "GFLOP") if max(flops) >= 1e8 else (1e6, "MFLOP")
    lines = [f"memory budget: {BUDGET_SETUP}@B = {BUDGET_HELP}. Per step (summed over its "
             f"graphs), max over ranks. budget, saved: {unit} the cut may / does save for the "
             f"backward (default: what the ordinary cut saves); recompute: {funit} the backward "
             f"recomputes, gap: at most this far from the least recompute within the budget; "
             f"fw end: {unit} alive when the forward ends; delta = ({BUDGET_SETUP}@B - "
             f"{BUDGET_SETUP}) / {BUDGET_SETUP}, lower is better",
             f"{'config':<24} {'setup':<12} {'budget':>8} {'saved':>8} {'default':>8} "
             f"{'recompute':>9} {'gap':>8} {'fw end':>8} {'peak':>8} {'delta':>7} "
             f"{'step s':>7} {'delta':>7}"]
    several = _several_worlds(folded)

    def num(v, s, width, digits=2):
        return f"{'-':>{width}}" if v is None or math.isnan(v) else f"{v / s:>{width}.{digits}f}"

    for (world, emulated, backend, precision), ours, cells in groups:
        name = f"{backend}+{precision}" + (f" (w{world}{', emulated' if emulated else ''})"
                                          if several else "")
        default = next((c["budget_default_saved_bytes"] for _, c in cells
                        if c["budget_default_saved_bytes"] is not None), None)
        if ours is not None:
            lines.append(f"{name:<24} {BUDGET_SETUP:<12} {'-':>8} {num(default, scale, 8)} "
                         f"{num(default, scale, 8)} {'-':>9} {'-':>8} "
                         f"{num(ours['boundary_bytes'], scale, 8)} "
                         f"{num(ours['peak_bytes'], scale, 8)} {'':>7} "
                         f"{num(ours['step_s'], 1.0, 7, 3)} {'':>7}")
        for setup, c in cells:
            if c["infeasible"]:
                lines.append(f"{name:<24} {setup:<12} {infeasible_text(c, scale, unit)}")
                continue
            dm = _delta(c["peak_bytes"], ours["peak_bytes"]) if ours else "n/a"
            dt = _delta(c["step_s"], ours["step_s"]) if ours else "n/a"
            lines.append(f"{name:<24} {setup:<12} {num(c['budget_bytes'], scale, 8)} "
                         f"{num(c['budget_saved_bytes'], scale, 8)} "
                         f"{num(c['budget_default_saved_bytes'], scale, 8)} "
                         f"{num(c['recompute_flops'], fscale, 9, 3)} "
                         f"{num(c['optimality_gap_flops'], fscale, 8, 3)} "
                         f"{num(c['boundary_bytes'], scale, 8)} "
                         f"{num(c['peak_bytes'], scale, 8)} {dm:>7} "
                         f"{num(c['step_s'], 1.0, 7, 3)} {dt:>7}")
    return "\n".join(lines)


def footer(folded: dict, meta: dict) -> str:
    """Definitions of the step and the precisions (the setups are under the main table); the
    activation formula beside the baseline's measured saved activations; warnings."""
    size = meta["size"]
    s, b, h, a = size["seq"], size["batch"], size["hidden"], size["heads"]
    formula = korthikanti_bytes_per_layer(s, b, h, a)
    scale, unit = (2**20, "MB") if formula < 2**30 else (2**30, "GB")
    lines = [
        STEP_DEFINITION,
        *([f"{BUDGET_SETUP}@B = {BUDGET_HELP}."] if any(is_budget_label(k[4]) for k in folded)
          else []),
        "precisions: " + "; ".join(f"{k} = {v}" for k, v in PRECISION_HELP.items()) + ".",
        f"Activations a transformer layer keeps, as Korthikanti et al. 2022 count them "
        f"(\"Reducing Activation Recomputation in Large Transformer Models\"), no dropout, "
        f"16-bit: "
        f"sbh(32 + 2as/h) = {formula / scale:.3f} {unit} (seq s={s}, batch b={b}, hidden h={h}, heads a={a}); "
        "with dropout sbh(34 + 5as/h) = "
        f"{korthikanti_bytes_per_layer(s, b, h, a, dropout=True) / scale:.3f} {unit}.",
    ]
    measured = [(k, c) for k, c in folded.items() if k[4] == "baseline"]
    if measured:
        parts = [f"{k[2]}+{k[3]} {c['activation_bytes_per_block'] / scale:.3f}"
                 for k, c in measured if not math.isnan(c["activation_bytes_per_block"])]
        lines.append("Baseline's measured saved activation bytes per block (" + unit + "): "
                     + ", ".join(parts) + ". Under autocast the residual stream and layer-norm "
                     "inputs stay fp32; the partitioners recompute cheap pointwise ops.")
    if any(k[1] for k in folded):
        lines.append("emulated: torch's fake process group in one process: per-rank memory "
                     "exact, collectives skipped (gathered weights hold no data), so it is not "
                     "timed.")
    if meta.get("device") == "cpu" and not all(c["exact_counter"] for c in folded.values()):
        lines.append("WARNING: the CPU allocator counted only the profiled threads (c10's "
                     "report_cpu_memory_usage flag could not be set): peaks may drift by the "
                     "size of tensors gloo's threads released.")
    return "\n".join(lines)


def header(meta: dict) -> str:
    """One line: model, ranks, torch, steps."""
    where = (f"{meta['world']} {meta['device'].upper()} ranks ({meta['dist_backend']})"
             if not meta.get("emulated_world") or meta.get("world") else "")
    emu = (f"emulated world {meta['emulated_world']} (fake process group)"
           if meta.get("emulated_world") else "")
    timed = (f"warm-up {meta['warmup']}, timed steps {meta['steps']}, " if meta.get("world")
             else "not timed, ")
    return (f"{meta['model']}; " + ", ".join(x for x in (where, emu) if x)
            + f"; torch {meta['torch']}; {timed}profiled steps {meta.get('profiled_steps', 1)}")


def render(folded: dict, meta: dict) -> str:
    """The whole report, from fold(rows)."""
    parts = [header(meta), main_table(folded), detail_table(folded), budget_table(folded),
             footer(folded, meta)]
    return "\n\n".join(p for p in parts if p)


CSV_EXCLUDE = ("timeline", "step_times_s", "activation_bytes_per_block", "peak_bytes_each_step")


def write_json(path: str, rows: list, meta: dict) -> None:
    """results.json: meta and every rank's rows."""
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def write_csv(path: str, rows: list) -> None:
    """results.csv: one line per rank and cell, without the timeline and per-step lists."""
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r if k not in CSV_EXCLUDE))
    keys.append("activation_bytes_per_block_mean")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**{k: r.get(k) for k in keys},
                        "activation_bytes_per_block_mean": _mean_per_block(r)})


def load(path: str) -> tuple[list, dict]:
    """(rows, meta) of a results.json."""
    with open(path) as f:
        data = json.load(f)
    return data["rows"], data["meta"]


def cell(folded: dict, backend: str, precision: str, setup: str,
         world: Optional[int] = None) -> dict:
    """The folded figures of one cell (the first world that has it, unless given)."""
    for key, c in folded.items():
        if key[2:] == (backend, precision, setup) and (world is None or key[0] == world):
            return c
    raise KeyError((backend, precision, setup, world))
