"""The systems a user would pick instead, each set up the way its own documentation does it, on
the same model, micro-batch, seed and ranks; a full training step each (forward, backward,
AdamW step, gradients released).

    ours-compile                    zero3.shard + dcr.compile(model): the README's program
                                    (each repeated layer compiled on its own, the rest one
                                    eager unit; the whole model where there are no layers)
    ours-eager / ours-inductor      zero3.shard + torch.compile(backend=dcr.backend(kind)),
                                    torch.optim.AdamW on the shards; RematConfig's defaults
                                    (bucket_bytes "auto": a layer's gathers in one collective,
                                    its gradients in one reduce-scatter)
    ours-inductor-layer-buckets     the same with bucket_bytes = one layer's weights in 16 bits:
                                    gathers and reduce-scatters grouped like FSDP2's per-layer
                                    all-gathers (fewer collectives, a layer gathered at once)
    ours-inductor-blocks            the layer-bucket row with each layer compiled on its own, the
                                    model around the layers eager (fsdp2-block-compiled's way)
                                    and one zero3.eager_unit (FSDP2's root unit: its parameters
                                    gathered in one collective, reduce-scattered in one).
                                    A transformers model compiled whole with HF checkpointing
                                    builds its causal mask inside the graph and every SDPA gets
                                    attn_mask=<mask>, is_causal=False: ~40% more time per
                                    attention call on CPU (benchmarks/README.md). Per layer the
                                    mask is built eagerly and SDPA gets is_causal=True
    ours-inductor-blocks-grad-buckets   the same with buckets of a layer's weights in 32 bits:
                                    its fp32 gradients leave in one reduce-scatter (FSDP2's
                                    count), held until the last of them exists
    ours-inductor-mp                zero3.shard(param_dtype=bf16) instead of torch.autocast:
                                    FSDP2's mixed precision (bf16 weights and activations
                                    everywhere, fp32 shards and gradient reduce), the numerics
                                    of the fsdp2 rows rather than autocast's (autocast only);
                                    ours-compile-mp: the same under dcr.compile
    ours-deepspeed                  stock DeepSpeed ZeRO-3 engine with the "deepcompile_remat"
                                    block (inductor): our takeover, as a user gets it (each
                                    layer compiled on its own, the rest one eager unit:
                                    compile_scope "auto"; --ours-config sets other keys)
    fsdp2-block / -block-compiled   PyTorch FSDP2 fully_shard on every layer, then the root
                                    (torchtitan's wrapping), optionally each layer compiled
                                    (inductor) before sharding
    fsdp2-module                    fully_shard on every module that holds parameters: FSDP2's
                                    finest wrapping, its least memory
    deepspeed / deepspeed-lean      stock ZeRO-3: DeepSpeed's defaults (which preallocate its
                                    reduce and prefetch buckets: 3 GB at 5e8 elements); the lean
                                    knobs (nothing kept gathered: max_live_parameters,
                                    max_reuse_distance, prefetch_bucket_size and the persistence
                                    threshold 0; reduce_bucket_size hidden^2, HF's "auto")
    deepspeed(-lean)-compiled       the same plus engine.compile(backend="inductor")
    deepspeed-lean-offload /        the lean knobs / our block, with "offload_optimizer" on
    ours-deepspeed-offload          the host ("cpu"; a torch AdamW stepped there): held bytes
                                    name what is on the host ("[host]")
    ...-offload-params / -all       the same with "offload_param" on the host instead of
                                    "offload_optimizer" / with both (axolotl's "all")
    ours-deepspeed-bf16-master /    "bf16" with DeepSpeed's "bf16_master_weights_and_grads" and
    deepspeed-lean-bf16-master      "bf16_optimizer_states": no fp32 master or states, the
                                    numerics of the fsdp2 rows under "bf16" ("bf16" only)

Precision "autocast": fp32 parameters and bf16 compute (ours and DeepSpeed: torch.autocast;
FSDP2: its MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), how FSDP2 does it).
"bf16": bf16 parameters (DeepSpeed "bf16" keeps fp32 master weights for its optimizer besides;
ours and FSDP2 step on the bf16 parameters themselves).

Each peer is a function (workload, precision, device, remat) -> System, where `remat` is a dict
of RematConfig fields for ours (compare --ours-config; the others ignore it). A peer that cannot
run here raises Unavailable with the reason (DeepSpeed not installed, ...). System.facts go into
the peer's rows: the DeepSpeed peers record taken_over (engine.dcr_takeover is set).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.profiler import record_function

from dcr_bench.harness.workload import Workload, blocks, leaf_modules

FWD_BWD = "dcr.peers.forward_backward"
OPTIMIZER = "dcr.peers.optimizer"
LR = 1e-4


class Unavailable(RuntimeError):
    """This peer cannot run here; the message says why."""


@dataclass
class System:
    """One peer, built and ready: a training step, and what to close and record afterwards."""
    step: Callable[[dict], float]  # one training step on a micro-batch; returns its loss
    close: Callable[[], None] = lambda: None  # releases what it holds (a DeepSpeed engine)
    notes: list = field(default_factory=list)  # how it was set up; the table lists them
    facts: dict = field(default_factory=dict)  # recorded in the system's rows (results.json)
    # What it holds at rest, by owner (bytes), read after the measured steps; in the rows too.
    held: Callable[[], dict] = lambda: {}


def _autocast(precision: str, device) -> contextlib.AbstractContextManager:
    if precision == "autocast":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _plain_step(w: Workload, run, optimizer, precision: str, device, autocast=True):
    def step(batch: dict) -> float:
        with record_function(FWD_BWD):
            with _autocast(precision, device) if autocast else contextlib.nullcontext():
                loss = w.loss(run, batch)
            loss.backward()
        with record_function(OPTIMIZER):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


# --- ours ----------------------------------------------------------------------------------------

def _layer_bytes(model: torch.nn.Module, element_bytes: int = 2) -> int:
    """One layer's weights at `element_bytes` each: 2, what its gathers move under autocast or
    bf16; 4, its fp32 gradients (what its reduce-scatters move under autocast)."""
    return max(sum(p.numel() for p in block.parameters()) for block in blocks(model)) * \
        element_bytes


def ours(kind: str, layer_buckets: bool = False, mixed_precision: bool = False,
         per_block: bool = False, bucket_element_bytes: int = 2, entry_point: bool = False):
    """The ours-* peer for backend `kind`: zero3.shard and torch.compile with dcr.backend(kind);
    buckets of one layer's weights with layer_buckets (at bucket_element_bytes a weight: 2, a
    layer's 16-bit gathers; 4, also its fp32 gradients in one reduce-scatter, which only
    per_block can afford: compiled whole, that budget would gather the next layer's weights
    early), bf16 parameters through
    zero3.shard(param_dtype=) with mixed_precision, each layer compiled on its own (the rest
    of the model eager, as fsdp2-block-compiled) with per_block, dcr.compile (the README's
    program) with entry_point. Returns the peer's factory."""
    def make(w: Workload, precision: str, device, remat: dict) -> System:
        import deepcompile_remat as dcr
        from deepcompile_remat import zero3

        if mixed_precision and precision != "autocast":
            raise Unavailable("bf16 parameters: param_dtype=bf16 changes nothing (the "
                              "ours-inductor row)")
        model = w.build(precision, device)
        if layer_buckets:
            remat = {**remat, "bucket_bytes": _layer_bytes(model, bucket_element_bytes)}
        config = dcr.RematConfig(**remat)
        model = zero3.shard(model, config=config,
                            param_dtype=torch.bfloat16 if mixed_precision else None)
        if entry_point:  # the README's program: dcr.compile, its compile_scope "auto"
            run = dcr.compile(model, config, kind)
        elif per_block:  # torchtitan's way: the layers compiled, the model around them eager
            for block in blocks(model):
                block.compile(backend=dcr.backend(kind, config))
            # ... and one unit, as FSDP2's root: one gather and one reduce-scatter a step
            zero3.eager_unit(model, exclude=blocks(model))
            run = model
        else:
            run = torch.compile(model, backend=dcr.backend(kind, config))
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        # Mixed precision is the parameters' dtype, as in FSDP2: no torch.autocast on top.
        return System(_plain_step(w, run, optimizer, precision, device,
                                  autocast=not mixed_precision),
                      notes=["shard(param_dtype=bf16), no autocast"] if mixed_precision else [])

    return make


# --- DeepSpeed -------------------------------------------------------------------------------------

def _deepspeed_available() -> None:
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        raise Unavailable(f"DeepSpeed is not installed ({e}); scripts/install.sh installs it")


def _ds_config(w: Workload, precision: str, lean: bool, ours_on: bool, remat: dict,
               offload: tuple = (), bf16_master: bool = False) -> dict:
    zero = {"stage": 3}
    for what in offload:  # "optimizer" on the host: a torch optimizer there (no cpu_adam build)
        zero[f"offload_{what}"] = {"device": "cpu", "pin_memory": False}
    if lean:
        zero.update(stage3_max_live_parameters=0, stage3_max_reuse_distance=0,
                    stage3_prefetch_bucket_size=0, stage3_param_persistence_threshold=0,
                    reduce_bucket_size=w.hidden * w.hidden)
    cfg = {"train_micro_batch_size_per_gpu": w.batch, "gradient_accumulation_steps": 1,
           "steps_per_print": 10 ** 9, "zero_allow_untested_optimizer": True,
           "zero_optimization": zero,
           "zero_force_ds_cpu_optimizer": "optimizer" not in offload}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
        if bf16_master:
            cfg["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    else:
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    if ours_on:
        cfg["deepcompile_remat"] = {"enabled": True, "backend": "inductor", **remat}
    return cfg


def deepspeed(*, lean: bool = False, compiled: bool = False, ours_on: bool = False,
              offload: tuple = (), bf16_master: bool = False):
    """A stock DeepSpeed ZeRO-3 peer: DeepSpeed's defaults, or its least-memory knobs with
    `lean`; engine.compile with `compiled`; our "deepcompile_remat" block with `ours_on`;
    what `offload` names ("optimizer", "param") offloaded to the host; master weights,
    gradients and optimizer states in bf16 with `bf16_master` ("bf16" only). Returns the
    peer's factory."""
    def make(w: Workload, precision: str, device, remat: dict) -> System:
        _deepspeed_available()
        if bf16_master and precision != "bf16":
            raise Unavailable("bf16 master weights are a \"bf16\" setting of DeepSpeed's")
        if torch.device(device).type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepcompile_remat.deepspeed import initialize

        model = w.build(precision, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        engine, *_ = initialize(model=model, optimizer=optimizer,
                                config=_ds_config(w, precision, lean, ours_on, remat, offload,
                                                  bf16_master))
        if compiled:
            engine.compile(backend="inductor")

        def step(batch: dict) -> float:
            with record_function(FWD_BWD):
                loss = w.loss(engine, batch)
                engine.backward(loss)
            with record_function(OPTIMIZER):
                engine.step()
            return float(loss.detach())

        notes = ["DeepSpeed's torch_autocast"] if precision == "autocast" else []
        # Whether our takeover holds the engine (ours-deepspeed) or DeepSpeed runs as it ships:
        # a block that never reached DeepSpeed would make ours-deepspeed stock DeepSpeed again.
        taken_over = getattr(engine, "dcr_takeover", None) is not None

        def held() -> dict:
            from deepcompile_remat.deepspeed.accounting import held_bytes

            return held_bytes(engine).by_owner

        return System(step, close=engine.destroy, notes=notes, facts={"taken_over": taken_over},
                      held=held)

    return make


# --- FSDP2 -------------------------------------------------------------------------------------------

def fsdp2(granularity: str, compiled: bool = False):
    """An FSDP2 peer: fully_shard on every layer ("block") or every module holding parameters
    ("module"), then the root; each unit compiled before sharding with `compiled`. Returns the
    peer's factory."""
    def make(w: Workload, precision: str, device, remat: dict) -> System:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = w.build(precision, device)
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if precision == "autocast" else MixedPrecisionPolicy())
        units = blocks(model) if granularity == "block" else leaf_modules(model)
        for unit in units:
            if compiled:
                unit.compile()  # per block, before sharding (torchtitan's order)
            fully_shard(unit, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        # FSDP2's policy is its mixed precision: no torch.autocast on top.
        return System(_plain_step(w, model, optimizer, precision, device, autocast=False),
                      notes=["MixedPrecisionPolicy(bf16 params, fp32 reduce)"]
                      if precision == "autocast" else [])

    return make


PEERS: dict = {
    "ours-eager": ours("eager"),
    "ours-inductor": ours("inductor"),
    "ours-compile": ours("inductor", entry_point=True),
    "ours-compile-mp": ours("inductor", mixed_precision=True, entry_point=True),
    "ours-inductor-layer-buckets": ours("inductor", layer_buckets=True),
    "ours-inductor-blocks": ours("inductor", layer_buckets=True, per_block=True),
    "ours-inductor-blocks-grad-buckets": ours("inductor", layer_buckets=True, per_block=True,
                                              bucket_element_bytes=4),
    "ours-inductor-mp": ours("inductor", mixed_precision=True),
    "ours-deepspeed": deepspeed(lean=False, ours_on=True),
    "ours-deepspeed-offload": deepspeed(ours_on=True, offload=("optimizer",)),
    "ours-deepspeed-offload-params": deepspeed(ours_on=True, offload=("param",)),
    "ours-deepspeed-offload-all": deepspeed(ours_on=True, offload=("optimizer", "param")),
    "ours-deepspeed-bf16-master": deepspeed(ours_on=True, bf16_master=True),
    "fsdp2-block": fsdp2("block"),
    "fsdp2-block-compiled": fsdp2("block", compiled=True),
    "fsdp2-module": fsdp2("module"),
    "deepspeed": deepspeed(),
    "deepspeed-lean": deepspeed(lean=True),
    "deepspeed-compiled": deepspeed(compiled=True),
    "deepspeed-lean-compiled": deepspeed(lean=True, compiled=True),
    "deepspeed-lean-bf16-master": deepspeed(lean=True, bf16_master=True),
    "deepspeed-lean-offload": deepspeed(lean=True, offload=("optimizer",)),
    "deepspeed-lean-offload-params": deepspeed(lean=True, offload=("param",)),
    "deepspeed-lean-offload-all": deepspeed(lean=True, offload=("optimizer", "param")),
}
