"""The `deepcompile-remat` console command.

Each subcommand lives in its own module, which names itself (NAME) and provides
add_arguments(parser) and run(args) -> exit status; the first line of run's docstring is the
help text. Adding a subcommand is two lines here: import its module and add it to SUBCOMMANDS.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from dcr_bench.bench import budget as bench_budget
from dcr_bench.bench import deepspeed_bench
from dcr_bench.bench.partition import command as bench_partition
from dcr_bench.bench import solver as bench_solver
from dcr_bench import config_keys
from dcr_bench.profile import command as profile_command
from dcr_bench.profile import compare as compare_command
from dcr_bench.profile import cut_quality as cut_quality_command
from dcr_bench.profile import frontier as frontier_command
from dcr_bench.profile import peak_plan as peak_plan_command
from dcr_bench.traffic import command as traffic_command

SUBCOMMANDS = {
    profile_command.NAME: (profile_command.add_arguments, profile_command.run),
    compare_command.NAME: (compare_command.add_arguments, compare_command.run),
    frontier_command.NAME: (frontier_command.add_arguments, frontier_command.run),
    cut_quality_command.NAME: (cut_quality_command.add_arguments, cut_quality_command.run),
    peak_plan_command.NAME: (peak_plan_command.add_arguments, peak_plan_command.run),
    bench_solver.NAME: (bench_solver.add_arguments, bench_solver.run),
    bench_partition.NAME: (bench_partition.add_arguments, bench_partition.run),
    bench_budget.NAME: (bench_budget.add_arguments, bench_budget.run),
    deepspeed_bench.NAME: (deepspeed_bench.add_arguments, deepspeed_bench.run),
    config_keys.NAME: (config_keys.add_arguments, config_keys.run),
    traffic_command.NAME: (traffic_command.add_arguments, traffic_command.run),
}


def build_parser() -> argparse.ArgumentParser:
    """The deepcompile-remat parser: one subcommand per SUBCOMMANDS entry, its first docstring
    line as help, its run function as the `run` default."""
    parser = argparse.ArgumentParser(
        prog="deepcompile-remat", description="deepcompile_remat command-line tools")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add_arguments, run) in SUBCOMMANDS.items():
        summary = (run.__doc__ or "").strip().splitlines()[0] if run.__doc__ else None
        sub = commands.add_parser(name, help=summary, description=summary)
        add_arguments(sub)
        sub.set_defaults(run=run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parses `argv` (default: sys.argv[1:]) and runs the chosen subcommand; returns its exit
    status."""
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
