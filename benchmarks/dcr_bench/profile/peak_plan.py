"""deepcompile-remat peak-plan: peak-target mode, predicted against measured (one process).

    deepcompile-remat peak-plan --archs llama t5 --targets 1.0 0.9 0.8 0.7 --torch

For each architecture and precision, one training step compiled with the ordinary cut, then one
per target with RematConfig(peak_target=T) (partition/planner.py). A row gives:
  measured   the step's peak above what was alive before it (the harness's one memory meter:
             cut_quality.measure), median step s and CPU s, and the first step's s (it
             compiles: the planner's cost shows there);
  predicted  the planner's simulated step peak less the graph's inputs (parameters and batch,
             alive before the step), the largest over the compiled graphs;
  the plan   its family, the flops it recomputes, its gathered weights kept.
  held       whether a plan that reports its target met measured within it (a fraction: of
             the ordinary cut's measured peak; bytes: the measured peak plus the inputs).
A byte target no plan fits is a row saying so, with the smallest target the planner named (the
lowest simulated peak with its margin); a fraction no plan reaches takes the lowest plan ("not
met" in the plan column).
Without ZeRO-3 there are no gathers, so every plan is of the "re-gather" family (a cut of the
memory-budget hull) or the ordinary one; bench-style ZeRO-3 runs go through `frontier`.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Optional

from dcr_bench.profile.cut_quality import ARCHITECTURES, PRECISIONS, measure

NAME = "peak-plan"


def infeasible_cause(exc: BaseException):
    """The PeakTargetInfeasibleError behind `exc` (dynamo wraps what a partitioner raises in
    BackendCompilerFailed: its inner_exception, or the cause / context chain), else None."""
    from deepcompile_remat import PeakTargetInfeasibleError

    while exc is not None and not isinstance(exc, PeakTargetInfeasibleError):
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return exc


def torch_row(arch: str, kind: str, precision: str, steps: int, scale: int,
              device: str = "cpu") -> dict:
    """torch's min-cut on the same step (cut_quality.measure), for reference."""
    return {**measure(arch, "torch", kind, precision, steps, scale, device=device),
            "target": "torch"}


def plan_row(arch: str, kind: str, precision: str, target, steps: int, scale: int,
             device: str = "cpu") -> dict:
    """One measured row for `target` (None: the ordinary cut)."""
    from deepcompile_remat.config import RematConfig
    from deepcompile_remat.partition import clear_reports, reports

    clear_reports()
    row = {"arch": arch, "kind": kind, "precision": precision, "target": target}
    try:
        row.update(measure(arch, "ours", kind, precision, steps, scale,
                           config=RematConfig(peak_target=target), device=device))
    except Exception as e:
        cause = infeasible_cause(e)
        if cause is None:
            raise
        row.update(infeasible=True, needed_bytes=cause.min_bytes)
        return row
    plans = [r.plan for r in reports() if r.plan is not None]
    if plans:
        top = max(plans, key=lambda p: p.predicted_peak_bytes - p.inputs_bytes)
        row.update(predicted_bytes=top.predicted_peak_bytes - top.inputs_bytes,
                   default_predicted_bytes=top.default_peak_bytes - top.inputs_bytes,
                   inputs_bytes=top.inputs_bytes, planned_bytes=top.planned_bytes,
                   family=top.family, recompute_flops=sum(p.recompute_cost for p in plans),
                   kept_gathers=sum(p.kept_gathers for p in plans),
                   evaluated=sum(p.evaluated for p in plans),
                   met=all(p.met for p in plans),
                   candidates=sum(p.candidates for p in plans))
    return row


def held(row: dict, ordinary: Optional[dict]) -> str:
    """Whether a plan that reports its target met measured within it: a fraction T of the
    ordinary cut's measured peak (the row without a target of the same arch and precision),
    or T bytes for the step's peak above its start plus the graph's inputs (what the
    simulated peak counts: parameters, batch). '' where the plan reports it not met."""
    if not row.get("met", False) or isinstance(row["target"], str) or row["target"] is None:
        return ""
    t = row["target"]
    if t <= 1:
        if ordinary is None or "peak_bytes" not in ordinary:
            return "?"
        return "yes" if row["peak_bytes"] <= t * ordinary["peak_bytes"] else "OVER"
    return "yes" if row["peak_bytes"] + row["inputs_bytes"] <= t else "OVER"


def table(rows: list) -> str:
    """The rows as a text table (MB = 2**20 bytes)."""
    head = (f"{'arch':<13}{'prec':<6}{'target':>8}{'meas MB':>9}{'pred MB':>9}{'err':>8}"
            f"{'held':>6}{'step s':>8}{'cpu s':>8}{'1st s':>7}  plan")
    out = [head, "-" * len(head)]
    ordinary = {(r["arch"], r["precision"]): r for r in rows if r["target"] is None}
    for r in rows:
        t = ("none" if r["target"] is None else r["target"] if isinstance(r["target"], str)
             else f"{r['target']:g}")
        if r.get("infeasible"):
            out.append(f"{r['arch']:<13}{r['precision']:<6}{t:>8}  infeasible: a target "
                       f"needs {r['needed_bytes'] / 2**20:.1f} MB (inputs included: the "
                       f"smallest simulated peak with the margin)")
            continue
        meas = r["peak_bytes"] / 2**20
        pred = r.get("predicted_bytes")
        err = f"{(pred / 2**20 / meas - 1) * 100:+.1f}%" if pred is not None and meas else ""
        plan = (f"{r['family']}, {r['recompute_flops']:.3g} flops, "
                f"{r['evaluated']}/{r['candidates']} simulated"
                + ("" if r["met"] else ", not met: the lowest plan")) if "family" in r else (
            "torch's min-cut" if r["target"] == "torch" else "ordinary")
        out.append(f"{r['arch']:<13}{r['precision']:<6}{t:>8}{meas:>9.1f}"
                   f"{(pred / 2**20 if pred is not None else float('nan')):>9.1f}{err:>8}"
                   f"{held(r, ordinary.get((r['arch'], r['precision']))):>6}"
                   f"{r['step_s']:>8.3f}{r['cpu_s']:>8.3f}{r['first_step_s']:>7.1f}  {plan}")
    return "\n".join(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's flags."""
    p.add_argument("--archs", nargs="+", choices=ARCHITECTURES, default=["llama", "t5"])
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=["fp32"])
    p.add_argument("--kind", choices=("inductor", "eager"), default="inductor")
    p.add_argument("--targets", nargs="+", type=float, default=[1.0, 0.9, 0.8, 0.7],
                   help="peak_target values (<= 1: a fraction of the ordinary cut's peak)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    p.add_argument("--scale", type=int, default=1,
                   help="sequence (x256) or image side (x64) multiplier")
    p.add_argument("--torch", action="store_true",
                   help="also measure torch's min-cut (RematConfig(enabled=False)) first")
    p.add_argument("--out", default=None, help="folder for rows.json and table.txt")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")


def run(args) -> int:
    """Peak-target mode: the planner's predicted step peak against the measured one."""
    rows = []
    for arch in args.archs:
        for precision in args.precisions:
            if args.torch:
                rows.append(torch_row(arch, args.kind, precision, args.steps, args.scale,
                                      args.device))
            rows += [plan_row(arch, args.kind, precision, target, args.steps, args.scale,
                              args.device)
                     for target in [None, *args.targets]]
    text = table(rows)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "rows.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(args.out, "table.txt"), "w") as f:
            f.write(text + "\n")
    return 0
