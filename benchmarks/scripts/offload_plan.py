"""Activation offload (RematConfig.offload_activations) at a training shape: what the plan
moves and the memory simulator's step peak before and after, per compiled graph. Llama, 4
layers, seq 1024, autocast, ZeRO-3 on 2 gloo ranks, one step (the eager backend: the plan is
the same under inductor).

    PYTHONPATH=benchmarks SCOPE=model HIDDEN=512 RATE=16000 \
        torchrun --nproc_per_node 2 benchmarks/scripts/offload_plan.py

RATE: host_link_flops_per_byte (16000: H100 over PCIe Gen5; 900: a GH200-class link);
SCOPE: compile_scope ("model": one graph, where the simulator sees every layer's activations
held across the step; "auto": per layer, where each graph holds only its own); CKPT=1: HF
checkpointing."""
import os, sys, torch, torch.distributed as dist
import deepcompile_remat as dcr
from deepcompile_remat import zero3
from dcr_bench.harness import models
import torch._inductor.config as ic; ic.fx_graph_cache = False
import torch._functorch.config as fc; fc.enable_autograd_cache = False
dist.init_process_group("gloo")
rate = float(os.environ.get("RATE", "16000"))
ckpt = bool(os.environ.get("CKPT"))
torch.manual_seed(0)
model = models.build_hf("llama", vocab=512, layers=4, hidden=int(os.environ.get("HIDDEN", "256")),
                        dropout=0.0)
if ckpt: models.enable_hf_checkpointing(model, use_reentrant=False)
zero3.shard(model)
config = dcr.RematConfig(offload_activations=True, host_link_flops_per_byte=rate,
                         compile_scope=os.environ.get("SCOPE", "auto"))
run = dcr.compile(model, config, "eager")
ids = torch.randint(0, 512, (1, 1024))
with torch.autocast("cpu", dtype=torch.bfloat16):
    loss = run(input_ids=ids, labels=ids).loss
loss.backward()
if dist.get_rank() == 0:
    for r in dcr.reports():
        o = r.offload
        print(f"rate {rate:g} ckpt {ckpt}: saved {r.saved_activation_bytes / 2**20:.1f} MiB "
              "activations;",
              o.summary()[2:], [(n, round(b/2**20, 2)) for n, b in o.values])
dist.destroy_process_group()
