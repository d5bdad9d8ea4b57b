"""The transformers table: stock DeepSpeed ZeRO-3 against the flag on, for every preset x
backend x precision x HF activation checkpointing, on 2 CPU ranks.

    python benchmarks/scripts/hf_deepspeed_table.py [--layers 4 --hidden 256 ...]

Each cell is one `deepcompile-remat bench-deepspeed --model PRESET ... --json` run (stock and
ours in the same rank processes, same seed and data). Printed per cell: the largest loss
difference from stock over every step, and the forward+backward peak (MB above the step's
start, the CPU allocator's total counted in every thread, the larger rank) of stock and ours.
"""
from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys


def _cell(preset, backend, precision, checkpointing, a) -> dict:
    cmd = [sys.executable, "-m", "deepcompile_remat", "bench-deepspeed", "--json",
           "--model", preset, "--backend", backend, "--precision", precision,
           "--layers", str(a.layers), "--hidden", str(a.hidden), "--heads", str(a.heads),
           "--vocab", str(a.vocab), "--seq", str(a.seq), "--batch", str(a.batch),
           "--steps", str(a.steps)]
    if checkpointing:
        cmd.append("--checkpointing")
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        return {"error": (run.stderr or run.stdout).strip().splitlines()[-1]}
    rows = json.loads(run.stdout[run.stdout.rindex("[\n {"):])  # after DeepSpeed's log lines
    by = {(r["setup"], r["rank"]): r for r in rows}
    ranks = sorted({r["rank"] for r in rows})
    diff = max(abs(x - y) for rank in ranks
               for x, y in zip(by["ours", rank]["losses"], by["stock", rank]["losses"]))
    peak = {s: max(by[s, rank]["fwd_bwd_peak_mb"] for rank in ranks)
            for s in ("stock", "ours")}
    return {"loss_diff": diff, "stock_mb": peak["stock"], "ours_mb": peak["ours"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["llama", "qwen2", "gpt2"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=1)
    a = p.parse_args()
    print(f"| model | backend | precision | checkpointing | loss diff vs stock | fwd+bwd peak "
          f"stock (MB) | ours (MB) | ours / stock |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for preset, backend, precision, ckpt in itertools.product(
            a.presets, ("eager", "inductor"), ("bf16", "autocast"), (False, True)):
        c = _cell(preset, backend, precision, ckpt, a)
        head = f"| {preset} | {backend} | {precision} | {'yes' if ckpt else 'no'} |"
        if "error" in c:
            print(f"{head} failed: {c['error']} | | | |", flush=True)
            continue
        print(f"{head} {c['loss_diff']:.1e} | {c['stock_mb']:.1f} | {c['ours_mb']:.1f} | "
              f"{c['ours_mb'] / c['stock_mb']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
