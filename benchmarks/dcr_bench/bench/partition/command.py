"""`deepcompile-remat bench-partition`: its flags, and the run that prints the depth sweep and
the end-to-end rows (or, with --compile-share, the compile shares) as tables or JSON."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from dcr_bench.bench.joint_capture import SPEED_GRAPHS, build_speed_model, capture_joint
from dcr_bench.bench.partition.compile_share import compile_share
from dcr_bench.bench.partition.depth_sweep import bench_one
from dcr_bench.bench.partition.speed import measure_speed
from dcr_bench.bench.partition.tables import format_depth_sweep, format_share, format_speed

NAME = "bench-partition"
DEFAULT_LAYERS = (2, 8, 24, 48)
DEFAULT_REPS = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds bench-partition's flags (depths, model size, policy, autocast; end-to-end graphs,
    repetitions, compile share) to `parser`."""
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--layers", type=int, nargs="*", default=list(DEFAULT_LAYERS),
                        help="GPT depths of the depth sweep (default "
                             f"{' '.join(map(str, DEFAULT_LAYERS))}; none: skip it)")
    parser.add_argument("--d-model", type=int, default=256, help="the depth sweep's width")
    parser.add_argument("--seq", type=int, default=64, help="the depth sweep's sequence")
    parser.add_argument("--policy", choices=("conservative", "aggressive"), default="conservative")
    parser.add_argument("--autocast", action="store_true",
                        help="capture the depth sweep under CPU bf16 autocast")
    parser.add_argument("--graphs", nargs="*", choices=list(SPEED_GRAPHS),
                        default=list(SPEED_GRAPHS),
                        help="end-to-end graphs: torch vs ours before vs ours, with our phases "
                             f"(default {' '.join(SPEED_GRAPHS)}; none: skip them)")
    parser.add_argument("--reps", type=int, default=DEFAULT_REPS,
                        help=f"end-to-end repetitions; medians are reported (default {DEFAULT_REPS})")
    parser.add_argument("--tiny", action="store_true",
                        help="end-to-end graphs at tiny sizes (2 layers; a smoke run)")
    parser.add_argument("--compile-share", nargs="+", choices=("eager", "inductor"),
                        help="instead: the partitioner's share of a whole torch.compile of the "
                             "--graphs models (first forward + backward less a warm step) on "
                             "these backends, before (torch's DCE, CSE and extraction) and after")


def run(args: argparse.Namespace) -> int:
    """Depth sweep and end-to-end speed of our partition_fn against torch's min-cut
    partitioner (or, with --compile-share, the partitioner's share of compile time)."""
    if args.reps < 1:
        raise SystemExit("deepcompile-remat bench-partition: --reps must be at least 1")
    if args.compile_share:
        shares = [compile_share(name, kind, args.tiny)
                  for name in args.graphs for kind in args.compile_share]
        print(json.dumps(shares, indent=1) if args.json else format_share(shares), flush=True)
        return 0
    rows = []
    if args.layers:
        # Warm-up: first calls pay imports and op-table construction; time neither of those.
        bench_one(1, d_model=args.d_model, seq=args.seq, autocast=args.autocast,
                  policy=args.policy)
    for layers in args.layers:
        rows.append(bench_one(layers, d_model=args.d_model, seq=args.seq,
                              autocast=args.autocast, policy=args.policy))
        if not args.json:
            print(format_depth_sweep(rows[-1:]).splitlines()[-1] if len(rows) > 1 else format_depth_sweep(rows),
                  flush=True)
    speed = []
    for name in args.graphs:
        fn, inputs = build_speed_model(name, args.tiny)
        speed.extend(measure_speed(name, capture_joint(fn, *inputs), args.reps, args.policy))
    if args.json:
        print(json.dumps({"depth_sweep": [asdict(r) for r in rows],
                          "end_to_end": [asdict(r) for r in speed]}, indent=1))
    elif speed:
        print(("\n" if rows else "") + format_speed(speed), flush=True)
    return 0
