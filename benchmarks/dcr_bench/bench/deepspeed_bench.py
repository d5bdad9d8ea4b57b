"""bench-deepspeed: stock DeepSpeed ZeRO-3 against the same engine with the flag on, CPU ranks.

Setups (same model, same seed, same ds_config apart from the "deepcompile_remat" block; torch's
AdamW as the client optimizer; DeepSpeed on its CPU accelerator over gloo). The model is the
built-in GPT, or a transformers model (--model llama|qwen2|gpt2|path/to/config.json, random
weights, dropout off so the setups draw nothing different), optionally with HF's activation
checkpointing (--checkpointing):
  stock           deepspeed.initialize, block disabled: DeepSpeed's eager ZeRO-3 (module hooks
                  gather before each submodule and release after)
  stock-compiled  the same plus engine.compile(backend="inductor"): what a DeepSpeed user gets
                  from torch.compile today (its hooks break the graph at every submodule)
  ours            deepcompile_remat.deepspeed.initialize, block enabled: our traced gathers,
                  min-cut partitioner and backend
Measured per rank: the peak live CPU bytes of one whole training step (engine(x),
engine.backward, engine.step) above its start, and of its forward+backward alone (the
optimizer step's fp32 temporaries, the same in every setup, can hide the difference), from the
harness's one meter: the CPU allocator's running total in the profiler, counted in every
thread (harness.memory.exact_cpu_counter, so gloo's worker threads' frees count too), which
counts tensors, not Python objects or DeepSpeed's own malloc'd state; the median step time
after two warm-up steps
(the compile), wall clock and this process's CPU time (all its threads: steadier than the wall
clock on a machine shared with other jobs). Every step's loss is kept: the largest difference
from stock's shows the setups train alike.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from deepcompile_remat.config import BACKEND_KINDS

NAME = "bench-deepspeed"
SETUPS = ("stock", "stock-compiled", "ours")


SIZES = {"layers": 8, "hidden": 1024, "heads": 16, "vocab": 512, "seq": 128, "batch": 1}


def _workload(a: argparse.Namespace):
    """The Workload run() resolved from the model flags (a config.json's own sizes included)."""
    from dcr_bench.harness.workload import Workload

    return Workload(**a.workload)


def ds_config(setup: str, a: argparse.Namespace) -> dict:
    """The DeepSpeed config of `setup` ("stock", "stock-compiled" or "ours"): ZeRO-3, the
    "deepcompile_remat" block enabled only for "ours", the precision and release flags of `a`."""
    cfg = {"train_micro_batch_size_per_gpu": a.batch, "steps_per_print": 10 ** 9,
           "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "deepcompile_remat": {"enabled": setup == "ours", "backend": a.backend}}
    if a.release_params:  # stock ZeRO-3 at its least memory: release each parameter after use
        cfg["zero_optimization"].update(stage3_max_live_parameters=0, stage3_max_reuse_distance=0,
                                        stage3_prefetch_bucket_size=0)
    if a.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    else:
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    return cfg


def _rank_main(rank: int, world: int, port: int, args_dict: dict) -> list:
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    from dcr_bench.harness import memory

    exact = memory.exact_cpu_counter()  # before anything is allocated
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity

    from deepcompile_remat.deepspeed import initialize
    from deepcompile_remat.deepspeed.accounting import held_bytes
    from dcr_bench.harness.models import hf_checkpointing_on
    from dcr_bench.harness.ranks import share_cores
    from dcr_bench.harness.workload import blocks

    share_cores(world)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    a = argparse.Namespace(**args_dict)
    rows = []
    for setup in a.setups:
        torch._dynamo.reset()
        workload = _workload(a)
        model = workload.build("autocast")  # fp32 weights: DeepSpeed's bf16 mode casts them
        built = {"model": type(model).__name__, "layers": len(blocks(model)),
                 "parameters": sum(p.numel() for p in model.parameters()),
                 "checkpointing": workload.is_hf and hf_checkpointing_on(model)}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, *_ = initialize(model=model, optimizer=opt, config=ds_config(setup, a))
        if setup == "stock-compiled":
            engine.compile(backend="inductor")
        batch = workload.inputs(rank)
        losses = []

        def forward_backward():
            loss = workload.loss(engine, batch)
            engine.backward(loss)
            losses.append(loss.item())
            return loss.item()

        def step():
            loss = forward_backward()
            engine.step()
            return loss

        for _ in range(2):  # compile, first optimizer step (its state is allocated)
            step()
        times, cpu_times = [], []
        for _ in range(a.steps):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
        dist.barrier()
        cpu = [ProfilerActivity.CPU]
        with memory.profiled(activities=cpu, profile_memory=True) as prof:
            step()
        dist.barrier()
        with memory.profiled(activities=cpu, profile_memory=True) as fwd_bwd_prof:
            loss = forward_backward()
        engine.step()
        held = held_bytes(engine)
        rows.append({"setup": setup, "rank": rank, "held_at_rest": held.by_owner,
                     "held_aliases": held.aliases,
                     "peak_mb": memory.peak_over_profile(prof) / 2**20,
                     "fwd_bwd_peak_mb": memory.peak_over_profile(fwd_bwd_prof) / 2**20,
                     "exact_counter": exact,
                     "step_ms": 1e3 * sorted(times)[len(times) // 2],
                     "cpu_ms": 1e3 * sorted(cpu_times)[len(cpu_times) // 2], "loss": loss,
                     "losses": losses,
                     "taken_over": getattr(engine, "dcr_takeover", None) is not None,
                     **built})
        engine.destroy()
        del engine, model, opt
    dist.destroy_process_group()
    return rows


def held_table(by_owner: dict, aliases: dict, numel: int) -> str:
    """held_bytes' table, from a row's JSON."""
    from deepcompile_remat.deepspeed.accounting import HeldBytes

    return HeldBytes(by_owner, aliases).table(numel)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds bench-deepspeed's flags (model, world, steps, precision, backend, setups) to
    `parser`."""
    parser.add_argument("--json", action="store_true")
    from dcr_bench.harness.workload import add_model_arguments

    add_model_arguments(parser, SIZES)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per setup (median)")
    parser.add_argument("--precision", choices=("bf16", "autocast"), default="bf16",
                        help='"bf16": {"enabled": true}, or "torch_autocast" with bfloat16')
    parser.add_argument("--backend", choices=BACKEND_KINDS, default="inductor",
                        help="the block's backend (setup ours)")
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=["stock", "ours"])
    parser.add_argument("--release-params", action="store_true",
                        help="stage3_max_live_parameters, stage3_max_reuse_distance and "
                             "stage3_prefetch_bucket_size 0 in every setup: stock ZeRO-3 releases "
                             "each parameter after use. Default: DeepSpeed's defaults, under "
                             "which a model this size stays gathered from forward to backward")


def run(args: argparse.Namespace) -> int:
    """Peak memory and step time per rank: stock DeepSpeed ZeRO-3 vs the flag on (CPU, gloo)."""
    from dcr_bench.harness.ranks import free_port, spawn_for_rows

    try:
        import deepspeed  # noqa: F401
    except ImportError:
        print("bench-deepspeed needs deepspeed (scripts/install.sh installs it)")
        return 2
    import dataclasses

    from dcr_bench.harness.workload import workload_from_args

    w = workload_from_args(args, NAME, SIZES)
    args_dict = {k: v for k, v in vars(args).items() if k not in ("run", "command")}
    args_dict["workload"] = dataclasses.asdict(w)
    rows = spawn_for_rows(_rank_main, args.world, args.world, free_port(), args_dict)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    knobs = "parameters released after use" if args.release_params else "DeepSpeed's defaults"
    model = "GPT" if w.model == "gpt" else w.model
    ckpt = ", activation checkpointing" if w.checkpointing else ""
    print(f"{model} {w.layers} layers, hidden {w.hidden}{ckpt}, batch {w.batch}x{w.seq}, "
          f"{args.world} CPU ranks (gloo), DeepSpeed ZeRO-3 ({knobs}), {args.precision}, ours "
          f"with {args.backend}; per rank, whole training steps:")
    print("peak MB above the step's start, whole step and forward+backward alone: the CPU "
          "allocator's total, counted in every thread")
    print(f"{'setup':<15} {'rank':>4} {'peak step':>10} {'peak f+b':>9} {'step ms':>9} "
          f"{'cpu ms':>8} {'last loss':>10} {'loss diff':>9}")
    stock = {r["rank"]: r for r in rows if r["setup"] == "stock"}
    for r in rows:
        ref = stock.get(r["rank"])
        diff = (max(abs(x - y) for x, y in zip(r["losses"], ref["losses"]))
                if ref is not None else float("nan"))
        print(f"{r['setup']:<15} {r['rank']:>4} {r['peak_mb']:>10.1f} "
              f"{r['fwd_bwd_peak_mb']:>9.1f} {r['step_ms']:>9.1f} {r['cpu_ms']:>8.1f} "
              f"{r['loss']:>10.4f} {diff:>9.1e}")
    print("loss diff: the largest |loss - stock's loss| over every step (same data, same seed)")
    print("held at rest after a step, rank 0, by owner (MiB; bytes per parameter of the rank's shard):")
    for r in (r for r in rows if r["rank"] == 0):
        print(f"  {r['setup']}:")
        print(held_table(r["held_at_rest"], r["held_aliases"], r["parameters"] / args.world))
    if not all(r["exact_counter"] for r in rows):
        print("WARNING: c10's report_cpu_memory_usage flag could not be set: the peaks count only "
              "the profiled threads and may be high by buffers gloo's threads released")
    return 0
