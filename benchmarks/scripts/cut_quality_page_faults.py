"""cut-quality's side-by-side timing of one cell, with the minor page faults of every round.

    python benchmarks/scripts/cut_quality_page_faults.py ARCH PRECISION PROCESSES [--dynamic-malloc]

Runs cut_quality.measure_pair PROCESSES times, each in a fresh process, and prints per process
the median step ms of torch's cut and ours, then per round (median ms, minor page faults over
the round, system ms). --dynamic-malloc leaves glibc's thresholds as they are (the default
before harness/steady_malloc.py). The method behind
benchmarks/results/cut-quality/malloc-thresholds.txt.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def one_process(arch: str, precision: str, dynamic_malloc: bool) -> str:
    from dcr_bench.harness import steady_malloc
    from dcr_bench.profile import cut_quality

    if dynamic_malloc:
        steady_malloc.steady_cpu_malloc = lambda: False
    timed, rounds = cut_quality._timed, []

    def counted(step, device, steps):
        before = resource.getrusage(resource.RUSAGE_SELF)
        times, cpus = timed(step, device, steps)
        after = resource.getrusage(resource.RUSAGE_SELF)
        rounds.append((round(statistics.median(times) * 1e3, 1), after.ru_minflt - before.ru_minflt,
                       round((after.ru_stime - before.ru_stime) * 1e3)))
        return times, cpus

    cut_quality._timed = counted
    torch_row, ours_row = cut_quality.measure_pair(arch, "inductor", precision, steps=5, rounds=4)
    # measure_pair's rounds run torch-ours, ours-torch, torch-ours, ours-torch
    torch_rounds = [rounds[i] for i in (0, 3, 4, 7)]
    ours_rounds = [rounds[i] for i in (1, 2, 5, 6)]
    return (f"torch {torch_row['step_s'] * 1e3:.1f} {torch_rounds} "
            f"ours {ours_row['step_s'] * 1e3:.1f} {ours_rounds}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("arch")
    p.add_argument("precision", choices=("fp32", "bf16"))
    p.add_argument("processes", type=int)
    p.add_argument("--dynamic-malloc", action="store_true")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process
    args = p.parse_args()
    if args.one:
        print(one_process(args.arch, args.precision, args.dynamic_malloc), flush=True)
        return
    for i in range(args.processes):
        cmd = [sys.executable, __file__, args.arch, args.precision, "1", "--one"]
        out = subprocess.run(cmd + (["--dynamic-malloc"] if args.dynamic_malloc else []),
                             check=True, capture_output=True, text=True).stdout
        print(i, out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
