"""profile-zero3: what ZeRO-3 under torch.compile costs per rank, three ways, on CPU ranks.

Setups (all: the same GPT, sharded by zero3.shard over gloo, bf16 autocast, eager backend so
the FX graphs run as partitioned):
  torch-default   torch's min_cut_rematerialization_partition, no marking: gathered weights
                  look like activations and are saved for the backward
  mincut-marking  our min-cut with ZeRO-3 marking, no cast-before-gather, no schedule
                  (what DeepSpeed's PR #7609 does)
  ours            marking + cast-before-gather + the C++ re-gather schedule
Measured per rank over one forward+backward: peak bytes from the CPU allocator's own
accounting (torch.profiler memory events, relative to the step's start), step time, and bytes
received by allgathers; predicted peak from the memory simulator (csrc/memsim) run on the
partitioned forward and backward graphs.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import time

NAME = "profile-zero3"
SETUPS = ("torch-default", "mincut-marking", "ours")


def _peak_from_profiler(prof) -> int:
    """Peak live CPU bytes during the profiled region, from the allocator's own records.

    torch.profiler's memory timeline (a private API, hence the fallback) replays every
    allocation and free with its timestamp; summing ops' self memory instead misplaces frees
    that happen inside long parent ops (the whole backward is one)."""
    try:
        import numpy as np
        from torch.profiler._memory_profiler import MemoryProfileTimeline

        _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
        return int(np.asarray(sizes).sum(axis=1).max()) if len(sizes) else 0
    except Exception:  # noqa: BLE001 - the private API moved: coarse op-level accounting
        events = sorted(prof.events(), key=lambda e: (e.time_range.start, e.time_range.end))
        live = peak = 0
        for e in events:
            live += e.self_cpu_memory_usage
            peak = max(peak, live)
        return peak


def _predicted(gm, persistent_names) -> tuple[float, float]:
    """Simulated peak of a graph minus what exists before it runs (inputs that pre-exist)."""
    import numpy as np

    from deepcompile_remat import _C
    from deepcompile_remat.zero3.schedule import memory_arrays

    nodes, nbytes, alias_of, is_input, persistent, keep, tails, heads = memory_arrays(
        gm, persistent_names)
    order = np.asarray([i for i in range(len(nodes)) if not is_input[i]], dtype=np.int64)
    peak, _, _ = _C.simulate_memory(nbytes, alias_of, is_input, persistent, keep, tails, heads, order)
    return peak, float(nbytes[(is_input == 1) & (alias_of < 0)].sum())


def _backend(setup: str, predictions: list):
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from deepcompile_remat.backends import eager_graph_compiler, parameter_indices_of
    from deepcompile_remat.config import RematConfig
    from deepcompile_remat.partition import make_partition_fn

    def compile_fn(gm, example_inputs):
        params = parameter_indices_of(example_inputs)
        if setup == "torch-default":
            def inner(joint, joint_inputs, **kw):
                return min_cut_rematerialization_partition(joint, joint_inputs, **kw)
        else:
            cfg = RematConfig() if setup == "ours" else RematConfig(
                cast_before_gather=False, schedule_gathers=False)
            inner = make_partition_fn(cfg, parameter_indices=params)

        def partition(joint, joint_inputs, **kw):
            primals = [n.name for n in joint.graph.nodes if n.op == "placeholder"
                       and "tangents" not in n.name]
            shard_names = {primals[i] for i in params if i < len(primals)}
            fw, bw = inner(joint, joint_inputs, **kw)
            fw_peak, fw_in = _predicted(fw, shard_names)
            bw_peak, bw_in = _predicted(bw, shard_names)
            saved = sum(1 for _ in bw.graph.find_nodes(op="placeholder"))
            # The forward's inputs pre-exist the step; of the backward's, only the shards do.
            shards_bytes = bw_in - _predicted_saved_bytes(bw, shard_names)
            predictions.append({"fw": fw_peak - fw_in, "bw": bw_peak - shards_bytes, "saved": saved})
            return fw, bw

        return aot_autograd(fw_compiler=eager_graph_compiler(), bw_compiler=eager_graph_compiler(),
                            partition_fn=partition)(gm, example_inputs)

    return compile_fn


def _predicted_saved_bytes(bw, shard_names) -> float:
    import torch

    from deepcompile_remat.partition.fx_export import value_bytes

    return float(sum(value_bytes(n.meta.get("val")) for n in bw.graph.find_nodes(op="placeholder")
                     if n.name not in shard_names and isinstance(n.meta.get("val"), torch.Tensor)))


def _rank_main(rank: int, world: int, port: int, args_dict: dict, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from deepcompile_remat import zero3
    from deepcompile_remat.bench.models import GPT

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    a = argparse.Namespace(**args_dict)
    rows = []
    for setup in a.setups:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = zero3.shard(GPT(vocab=a.vocab, d=a.hidden, layers=a.layers, heads=a.heads,
                                max_t=a.seq))
        predictions: list = []
        run = torch.compile(model, backend=_backend(setup, predictions))
        idx = torch.randint(0, a.vocab, (a.batch, a.seq))

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = run(idx).float().logsumexp(-1).mean()
            loss.backward()
            for p in model.parameters():
                p.grad = None

        step()  # compile
        times = []
        for _ in range(a.steps):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        zero3.CommStats.reset()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                     with_stack=True) as prof:
            step()
        peak = _peak_from_profiler(prof)
        pred = predictions[-1]
        rows.append({"setup": setup, "rank": rank, "peak_mb": peak / 2**20,
                     "predicted_peak_mb": max(pred["fw"], pred["bw"]) / 2**20,
                     "step_ms": 1e3 * sorted(times)[len(times) // 2],
                     "allgather_mb_per_step": zero3.CommStats.allgather_bytes / 2**20,
                     "allgather_calls": zero3.CommStats.allgather_calls})
        del run, model
    dist.destroy_process_group()
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(rows, f)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per setup (median)")
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))


def run(args: argparse.Namespace) -> int:
    """Peak memory, step time and gather bytes per rank for three ZeRO-3 setups (CPU, gloo)."""
    import tempfile

    import torch.multiprocessing as mp

    from deepcompile_remat.bench.ports import free_port

    args_dict = {k: v for k, v in vars(args).items() if k not in ("run", "command")}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows")
        mp.spawn(_rank_main, args=(args.world, free_port(), args_dict, out), nprocs=args.world)
        rows = []
        for r in range(args.world):
            with open(f"{out}.{r}") as f:
                rows += json.load(f)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"GPT {args.layers} layers, hidden {args.hidden}, batch {args.batch}x{args.seq}, "
          f"{args.world} CPU ranks (gloo), bf16 autocast, eager backend; per rank:")
    print(f"{'setup':<16} {'rank':>4} {'peak MB':>9} {'predicted MB':>13} {'step ms':>9} "
          f"{'allgather MB':>13} {'gathers':>8}")
    for r in rows:
        print(f"{r['setup']:<16} {r['rank']:>4} {r['peak_mb']:>9.1f} {r['predicted_peak_mb']:>13.1f} "
              f"{r['step_ms']:>9.1f} {r['allgather_mb_per_step']:>13.1f} {r['allgather_calls']:>8}")
    return 0
