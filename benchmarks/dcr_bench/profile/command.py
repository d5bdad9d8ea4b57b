"""`deepcompile-remat profile`: the memory-profile experiments, end to end.

    deepcompile-remat profile                      # the default matrix on 2 local CPU ranks
    deepcompile-remat profile --fake-world 8       # ... and an emulated world of 8 for memory
    deepcompile-remat profile --device cuda --world 1 --fake-world 8 --layers 24 --hidden 2048
    deepcompile-remat profile --model llama --checkpointing    # a transformers model
    deepcompile-remat profile --budgets 1 0.5 0.2 0  # + ours in memory-budget mode per budget

Writes the table to stdout and results.json, results.csv, table.txt, memory_timeline.png and
peaks.png (with --budgets also budgets.png, peak against step time per budget) to --out; a
progress line goes to stderr while it runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import sys
import time

from deepcompile_remat.config import BACKEND_KINDS
from dcr_bench.harness.workload import add_model_arguments, workload_from_args
from dcr_bench.profile.setups import BUDGET_SETUP, PRECISIONS, SETUPS

NAME = "profile"

DEFAULTS = {"world": 2, "warmup": 1, "steps": 5, "profiled_steps": 2}


def _budget(text: str) -> float:
    """argparse type of --budgets: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"a budget must be >= 0 and finite, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `profile` subcommand's options."""
    d = DEFAULTS
    g = parser.add_argument_group("matrix")
    g.add_argument("--backends", nargs="+", choices=BACKEND_KINDS, default=list(BACKEND_KINDS))
    g.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    g.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    g.add_argument("--budgets", nargs="+", type=_budget, default=[], metavar="B",
                   help=f"also run {BUDGET_SETUP} in memory-budget mode once per budget (setup "
                        f"'{BUDGET_SETUP}@B', RematConfig(memory_budget=B)): B <= 1 a fraction "
                        "of the bytes the ordinary cut saves (0: the smallest legal cut), > 1 "
                        "bytes per graph; a byte budget below the smallest legal cut gives an "
                        "'infeasible' row; adds "
                        "budgets.png (peak against step time)")
    g = parser.add_argument_group("ranks")
    g.add_argument("--world", type=int, default=d["world"],
                   help="local rank processes (gloo on CPU, NCCL on GPU); 0: no real run")
    g.add_argument("--fake-world", type=int, default=0, metavar="N",
                   help="also run an emulated world of N ranks in one process (torch's fake "
                        "process group: per-rank memory exact, collectives skipped)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda when available")
    add_model_arguments(parser)
    g = parser.add_argument_group("run")
    g.add_argument("--warmup", type=int, default=d["warmup"], help="steps after the compile")
    g.add_argument("--steps", type=int, default=d["steps"], help="timed steps (median)")
    g.add_argument("--profiled-steps", type=int, default=d["profiled_steps"],
                   help="steps profiled for memory after the timed ones; each rank reports the "
                        "one with the smallest peak (gloo's threads free some buffers late)")
    g.add_argument("--out", default="profile-results", help="output folder")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--op-table", action="store_true",
                   help="rank 0 writes each cell's per-op profile (device and host time) to "
                        "<out>/ops/")
    g.add_argument("--quiet", action="store_true", help="no progress line")
    g.add_argument("--json", action="store_true", help="print results.json instead of the table")


def _device(kind: str) -> str:
    import torch

    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        raise SystemExit("deepcompile-remat profile: --device cuda, but torch sees no GPU")
    return kind


def _validate(args) -> None:
    if args.world < 0 or args.fake_world < 0 or (args.world == 0 and args.fake_world == 0):
        raise SystemExit("deepcompile-remat profile: need --world >= 1 or --fake-world >= 1")
    for name in ("steps", "profiled_steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"deepcompile-remat profile: --{name} must be >= 1")
    if args.warmup < 0:
        raise SystemExit("deepcompile-remat profile: --warmup must be >= 0")


def _run_pass(nprocs: int, world: int, emulated: bool, device: str, cells, workload, opts,
              show_progress: bool) -> list:
    from dcr_bench.harness.ranks import free_port, spawn_for_rows
    from dcr_bench.profile import measure

    return spawn_for_rows(measure.rank_main, nprocs, nprocs, world, emulated, free_port(),
                          device, cells, workload, opts, show_progress)


def _machine(device: str) -> str:
    import torch

    cpu = f"{os.cpu_count()}-core {platform.machine()} CPU"
    if device == "cuda":
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, {cpu}"
    return cpu


def run(args: argparse.Namespace) -> int:
    """Peak memory and step time of ZeRO-3 training: backends x precisions x setups."""
    import torch

    from dcr_bench.profile import measure, plots, results
    from dcr_bench.profile.setups import matrix

    _validate(args)
    device = _device(args.device)
    if device == "cuda" and args.world > torch.cuda.device_count():
        raise SystemExit(f"deepcompile-remat profile: --world {args.world} but only "
                         f"{torch.cuda.device_count()} GPUs")
    workload = workload_from_args(args, NAME)
    parameters = sum(p.numel() for p in workload.build("autocast").parameters())
    opts = measure.RunOptions(warmup=args.warmup, steps=args.steps,
                              profiled_steps=args.profiled_steps,
                              op_table_dir=os.path.join(args.out, "ops") if args.op_table else "")
    cells = matrix(args.backends, args.precisions, args.setups, args.budgets)
    show = not args.quiet
    t0 = time.perf_counter()
    rows = []
    if args.world:
        rows += _run_pass(args.world, args.world, False, device, cells, workload, opts, show)
    if args.fake_world:  # memory only: its gathers skip the data, so its times mean nothing
        emulated_opts = dataclasses.replace(opts, warmup=0, steps=0)
        rows += _run_pass(1, args.fake_world, True, device, cells, workload, emulated_opts, show)
    wall = time.perf_counter() - t0
    meta = {
        "command": "deepcompile-remat profile " + " ".join(
            shlex.quote(a) for a in (sys.argv[2:] if sys.argv[1:2] == [NAME] else [])),
        "date": datetime.date.today().isoformat(), "wall_s": wall,
        "model": workload.describe(parameters), "parameters": parameters,
        "size": {k: getattr(workload, k) for k in ("layers", "hidden", "heads", "vocab", "seq",
                                                   "batch")},
        "workload": dataclasses.asdict(workload),
        "world": args.world, "emulated_world": args.fake_world, "device": device,
        "dist_backend": "nccl" if device == "cuda" else "gloo",
        "torch": torch.__version__, "machine": _machine(device),
        "warmup": args.warmup, "steps": args.steps, "profiled_steps": args.profiled_steps,
        "budgets": list(args.budgets),
        "step": results.STEP_DEFINITION,
    }
    os.makedirs(args.out, exist_ok=True)
    folded = results.fold(rows)
    text = results.render(folded, meta) + f"\n\nwall time {wall:.0f} s on {meta['machine']}"
    results.write_json(os.path.join(args.out, "results.json"), rows, meta)
    results.write_csv(os.path.join(args.out, "results.csv"), rows)
    with open(os.path.join(args.out, "table.txt"), "w") as f:
        f.write(text + "\n")
    made = [] if args.no_plots else plots.write_all(rows, folded, args.out,
                                                     workload.describe(parameters), parameters)
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows}))
    else:
        print(text)
        written = [os.path.join(args.out, n) for n in ("results.json", "results.csv", "table.txt")]
        print("\nwrote " + ", ".join(written + made))
    return 0
