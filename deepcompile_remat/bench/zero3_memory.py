"""profile-zero3: what ZeRO-3 under torch.compile costs per rank, three ways, on CPU ranks.

Setups (all: the same GPT, sharded by zero3.shard over gloo, bf16 autocast, eager backend so
the FX graphs run as partitioned):
  torch-default   torch's min_cut_rematerialization_partition, no marking: gathered weights
                  look like activations and are saved for the backward
  mincut-marking  our min-cut with ZeRO-3 marking, no cast-before-gather, no schedule
                  (what DeepSpeed's PR #7609 does)
  ours            marking + cast-before-gather + the C++ re-gather schedule
Measured per rank over one forward+backward: peak bytes from the CPU allocator's own
accounting (its running total in torch.profiler's allocation events, relative to the step's
start; the profiler's memory timeline beside it as a cross-check), step time, and bytes
received by allgathers (the ops' own counter, plus the prefetched start/wait gathers counted
from the graphs, column "async"); predicted peak from the memory simulator (csrc/memsim) run on the
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


def _peak_from_allocator(prof) -> int:
    """Peak live CPU bytes during the profiled region, from the CPU allocator's own running
    total: every allocation and free event carries the allocator's total_allocated after it,
    so the peak is the largest total minus the total before the first event. Exact whatever
    the thread (gloo's included), and with no matching of frees to allocations."""
    from torch._C._profiler import _EventType
    from torch.profiler._memory_profiler import OpTree  # private API: the event tree

    events = [n.typed[1] for n in OpTree(prof.profiler.kineto_results).sorted_nodes
              if n.typed[0] == _EventType.Allocation and n.typed[1].device.type == "cpu"]
    if not events:
        return 0
    before = events[0].total_allocated - events[0].alloc_size
    return max(e.total_allocated for e in events) - before


def _peak_from_timeline(prof) -> float:
    """The same peak from torch.profiler's memory timeline, which replays allocations and
    frees matched by address; it over-counts when it cannot match a free (it warns
    "Mismatch between allocation and free"), so it is reported beside, as a cross-check.
    NaN where it cannot replay the step (its data-flow checks reject some in-place ops)."""
    import numpy as np
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    try:
        _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    except AssertionError:
        return float("nan")
    return float(np.asarray(sizes).sum(axis=1).max()) if len(sizes) else 0.0


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
            async_bytes, async_calls = map(sum, zip(_async_gathers(fw), _async_gathers(bw)))
            predictions.append({"fw": fw_peak - fw_in, "bw": bw_peak - shards_bytes, "saved": saved,
                                "async_bytes": async_bytes, "async_calls": async_calls})
            return fw, bw

        return aot_autograd(fw_compiler=eager_graph_compiler(), bw_compiler=eager_graph_compiler(),
                            partition_fn=partition)(gm, example_inputs)

    return compile_fn


def _async_gathers(gm) -> tuple[int, int]:
    """(bytes received, calls) of the gathers the schedule turned into functional-collective
    start/wait pairs: torch runs those, so CommStats does not see them; each graph runs once
    per step, so the graph says what they move."""
    import torch

    received = calls = 0
    for n in gm.graph.find_nodes(op="call_function",
                                 target=torch.ops._c10d_functional.all_gather_into_tensor.default):
        full, world = n.meta["val"], int(n.args[1])
        received += full.numel() * full.element_size() * (world - 1) // world
        calls += 1
    return received, calls


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
        pred = predictions[-1]
        rows.append({"setup": setup, "rank": rank, "peak_mb": _peak_from_allocator(prof) / 2**20,
                     "timeline_peak_mb": _peak_from_timeline(prof) / 2**20,
                     "predicted_peak_mb": max(pred["fw"], pred["bw"]) / 2**20,
                     "step_ms": 1e3 * sorted(times)[len(times) // 2],
                     "allgather_mb_per_step": (zero3.CommStats.allgather_bytes + sum(
                         p["async_bytes"] for p in predictions)) / 2**20,
                     "allgather_calls": zero3.CommStats.allgather_calls + sum(
                         p["async_calls"] for p in predictions),
                     "async_gathers": sum(p["async_calls"] for p in predictions)})
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
    print(f"{'setup':<16} {'rank':>4} {'peak MB':>9} {'timeline MB':>12} {'predicted MB':>13} {'step ms':>9} "
          f"{'allgather MB':>13} {'gathers':>8} {'async':>6}")
    for r in rows:
        print(f"{r['setup']:<16} {r['rank']:>4} {r['peak_mb']:>9.1f} {r['timeline_peak_mb']:>12.1f} {r['predicted_peak_mb']:>13.1f} "
              f"{r['step_ms']:>9.1f} {r['allgather_mb_per_step']:>13.1f} {r['allgather_calls']:>8} {r['async_gathers']:>6}")
    return 0
