"""Benchmark of the fused cast + allgather (deepcompile_remat.comm), GPU; --cpu: the CPU slot fill.

1. Cast kernel bandwidth: one multi-tensor launch over a bucket of Llama-7B-like shards,
   effective GB/s at 6 bytes per element (4 read + 2 written), next to a device-to-device
   copy of the same bytes in the same process (the roofline), torch's _foreach_copy_ into the
   same slots (what the runtime does without the kernel) and one .copy_ per tensor.
2. allgather_cast(bf16) (fused cast, then the process group's coalesced in-place gather: the
   runtime path) vs torch's fp32 all_gather_into_tensor then .to(bf16), per bucket: time and
   torch.cuda.max_memory_allocated. Both gather through torch's process group: only the
   cast differs.

3. --cpu: the CPU slot fill, our C++ kernel (deepcompile_remat._C, with its NaN probe) against
   torch's _foreach_copy_ and per-tensor copy_: why the runtime fills slots with torch on CPU.

    python benchmarks/scripts/bench_allgather_cast.py                 # one GPU (world 1)
    torchrun --nproc-per-node 8 benchmarks/scripts/bench_allgather_cast.py   # NCCL across GPUs
    python benchmarks/scripts/bench_allgather_cast.py --cpu           # no GPU needed
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from deepcompile_remat import comm

# One Llama-7B decoder layer (hidden 4096, MLP 11008): q, k, v, o, gate, up, down, 2 norms.
LAYER_SHAPES = [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)] + [(4096,)] * 2


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def make_bucket(layers: int, world: int, device) -> list:
    shards = []
    for _ in range(layers):
        for shape in LAYER_SHAPES:
            shard_len = -(-numel(shape) // world)  # padded
            shards.append(torch.randn(shard_len, device=device))
    return shards


def time_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def bench_cast_kernel(shards, iters: int) -> dict:
    from deepcompile_remat import _cuda

    outs = [torch.empty(s.numel(), dtype=torch.bfloat16, device=s.device) for s in shards]
    option = comm.torch_nan_option("cuda", torch.bfloat16)
    stream = torch.cuda.current_stream()
    args = ([s.data_ptr() for s in shards], [o.data_ptr() for o in outs],
            [s.numel() for s in shards], "bfloat16", option.nan_mode, option.canonical_nan)
    cast_ms = time_ms(lambda: _cuda.cast_into_slots(*args, stream.cuda_stream), iters)
    elements = sum(s.numel() for s in shards)
    flat_src = torch.empty(elements * 6 // 2, dtype=torch.uint8, device=shards[0].device)
    flat_dst = torch.empty_like(flat_src)
    copy_ms = time_ms(lambda: flat_dst.copy_(flat_src), iters)  # reads + writes 6 B/elem total
    torch_ms = time_ms(lambda: [o.copy_(s) for s, o in zip(shards, outs)], iters)
    foreach_ms = time_ms(lambda: torch._foreach_copy_(outs, shards), iters)
    gbs = lambda ms: elements * 6 / (ms * 1e-3) / 1e9  # noqa: E731
    return {"elements": elements, "cast_ms": cast_ms, "cast_GBps": gbs(cast_ms),
            "d2d_copy_ms": copy_ms, "d2d_copy_GBps": gbs(copy_ms),
            "cast_fraction_of_copy": copy_ms / cast_ms, "target_fraction": 0.85,
            "torch_foreach_copy_ms": foreach_ms, "torch_foreach_copy_GBps": gbs(foreach_ms),
            "torch_per_tensor_cast_ms": torch_ms, "torch_per_tensor_cast_GBps": gbs(torch_ms)}


def bench_cpu_fill(layers: int, iters: int) -> dict:
    """The CPU slot fill: our kernel vs torch, bf16 slots of a world-2 bucket, median of iters."""
    import time

    import numpy as np

    from deepcompile_remat import _C

    shards = make_bucket(layers, 2, "cpu")
    outs = [torch.empty(2 * s.numel(), dtype=torch.bfloat16) for s in shards]
    slots = [o.view(2, -1)[1] for o in outs]
    option = comm.torch_nan_option("cpu", torch.bfloat16)

    def kernel():  # the runtime's CPU path before: NaN probe (cached) + one C++ call
        _C.cast_shards_into_slots([s.numpy() for s in shards],
                                  [o.view(torch.int16).numpy() for o in outs],
                                  [s.numel() for s in shards], "bfloat16", option.nan_mode,
                                  option.canonical_nan)

    def median_ms(fn) -> float:
        fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return float(np.median(times)) * 1e3

    elements = sum(s.numel() for s in shards)
    result = {"threads": torch.get_num_threads(), "elements": elements}
    for name, fn in (("our_kernel", kernel),
                     ("torch_foreach_copy", lambda: torch._foreach_copy_(slots, shards)),
                     ("torch_copy_per_tensor", lambda: [d.copy_(s) for s, d in zip(shards, slots)])):
        ms = median_ms(fn)
        result[name] = {"ms": ms, "GBps": elements * 6 / (ms * 1e-3) / 1e9}
    for sl in slots:  # else the torch runs above already left the right bits there
        sl.fill_(float("nan"))
    kernel()
    want = [sl.clone() for sl in slots]
    torch._foreach_copy_(slots, shards)
    result["same_bits"] = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                              for a, b in zip(want, slots))
    return result


def bench_gather(shards, world: int, iters: int) -> dict:
    device = shards[0].device

    def fused():
        return comm.cast_and_gather(shards, dtype=torch.bfloat16)

    def baseline():
        outs = []
        for s in shards:
            full = torch.empty(world * s.numel(), dtype=s.dtype, device=device)
            if world > 1:
                dist.all_gather_into_tensor(full, s)
            else:
                full.copy_(s)
            outs.append(full.to(torch.bfloat16))
        return outs

    variants = [("fused_allgather_cast", fused), ("fp32_allgather_then_cast", baseline)]
    result = {}
    for name, fn in variants:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = time_ms(lambda: fn(), iters)
        result[name] = {"ms": ms,
                        "peak_extra_MiB": (torch.cuda.max_memory_allocated() - base) / 2**20}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2, help="decoder layers per bucket")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--cpu", action="store_true", help="the CPU slot fill only (no GPU)")
    args = p.parse_args()
    if args.cpu:
        results = {"cpu_fill": bench_cpu_fill(args.layers, args.iters)}
        print(json.dumps(results, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return

    world, rank = 1, 0
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        dist.init_process_group("nccl")
        world, rank = dist.get_world_size(), dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device())
    if not comm.cuda_available():
        raise SystemExit(f"_cuda not built: {comm.cuda_build_info()}")

    shards = make_bucket(args.layers, world, device)
    results = {"device": torch.cuda.get_device_name(device), "world": world,
               "layers": args.layers, "params": len(shards),
               "cast_kernel": bench_cast_kernel(shards, args.iters),
               "gather": bench_gather(shards, world, args.iters)}
    if rank == 0:
        print(json.dumps(results, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
