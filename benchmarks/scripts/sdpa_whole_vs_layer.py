"""Attention time per call: the model compiled whole against each layer compiled.

    python3 benchmarks/scripts/sdpa_whole_vs_layer.py whole ours ckpt
    python3 benchmarks/scripts/sdpa_whole_vs_layer.py layer ours ckpt
    python3 benchmarks/scripts/sdpa_whole_vs_layer.py whole torch ckpt   # torch's partitioner

One process, no ZeRO-3, llama 4x512 seq 1024 under CPU bf16 autocast, one intra-op thread:
three warm steps, then one profiled step; prints the step's wall and CPU seconds and the
milliseconds per call of the matmuls and of SDPA's forward and backward kernels. A
transformers model compiled whole with HF checkpointing builds its causal mask inside the
graph, and SDPA then runs with attn_mask=<mask>, is_causal=False (see inductor's output code:
TORCH_LOGS=output_code); compiled per layer, the mask is built eagerly and SDPA gets
is_causal=True. Run of 2026-11-26 (torch 2.13.0+cpu, transformers 5.23.0), SDPA forward /
backward ms per call:
    whole, ours, ckpt     24.6 / 37.9      layer, ours, ckpt     17.8 / 27.0
    whole, torch, ckpt    24.9 / 37.1
    whole, ours, no ckpt  17.8 / 26.5      layer, ours, no ckpt  18.0 / 26.3
"""
from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import deepcompile_remat as dcr
from dcr_bench.harness.workload import Workload, blocks


def main(mode: str, partitioner: str, checkpointing: bool) -> str:
    """The report for one configuration (module docstring)."""
    torch.set_num_threads(1)
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    w = Workload(model="llama", layers=4, hidden=512, heads=8, seq=1024,
                 checkpointing=checkpointing)
    torch.manual_seed(0)
    model = w.build("autocast")
    backend = dcr.backend("inductor", dcr.RematConfig(enabled=partitioner == "ours"))
    if mode == "whole":
        run = torch.compile(model, backend=backend)
    else:
        for block in blocks(model):
            block.compile(backend=backend)
        run = model
    batch = w.inputs(0)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = w.loss(run, batch)
        loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    lines = [f"{mode} {partitioner} checkpointing={checkpointing}: step {wall:.3f} s, "
             f"CPU {cpu:.3f} s"]
    for e in prof.key_averages():
        if "scaled_dot_product" in e.key or e.key == "aten::mm":
            lines.append(f"  {e.key}: {e.count} calls, "
                         f"{e.self_cpu_time_total / 1e3 / e.count:.2f} ms a call")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("whole", "layer") or sys.argv[2] not in (
            "ours", "torch") or sys.argv[3] not in ("ckpt", "no-ckpt"):
        sys.exit("usage: sdpa_whole_vs_layer.py {whole,layer} {ours,torch} {ckpt,no-ckpt}")
    print(main(sys.argv[1], sys.argv[2], sys.argv[3] == "ckpt"))
