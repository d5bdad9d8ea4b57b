"""Per-layer compile of a sharded model, torchtitan's way: each repeated layer compiled on its
own, the model around the layers (embeddings, final norm, head) eager and one unit.

    model = zero3.shard(model)
    zero3.compile_by_layer(model, dcr.backend("inductor"))

Why, against one compile of the whole model:

- the first step: dynamo compiles a layer's code once and every layer of the same class reuses
  that graph, so compile time does not grow with depth as a whole-model graph's does;
- HF activation checkpointing: a transformers model compiled whole builds its causal mask
  inside the graph and every SDPA gets ``attn_mask=<mask>, is_causal=False`` (about 40% more
  time per attention call on CPU); per layer the mask is built eagerly and SDPA gets
  ``is_causal=True``;
- collectives: inside a layer the compiled graph buckets its gathers (bucket_bytes "auto": one
  per layer and direction), and the parameters outside the layers are one eager unit
  (zero3/eager_unit.py): one gather and one reduce-scatter a step, as FSDP2's root unit.

The layers are the blocks of the model's stacks: each nn.ModuleList of two or more blocks
(modules with submodules) of one class, outermost first (a decoder's layers; an
encoder-decoder's encoder and decoder blocks); a model without one is compiled whole.
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch.nn as nn

from deepcompile_remat.zero3.eager_unit import eager_unit, owners_outside


def _is_stack(m: nn.Module) -> bool:
    """An nn.ModuleList of two or more blocks (modules with submodules) of one class."""
    return (isinstance(m, nn.ModuleList) and len(m) >= 2 and len({type(b) for b in m}) == 1
            and all(next(b.children(), None) is not None for b in m))


def repeated_layers(model: nn.Module) -> list:
    """The model's repeated layers: the blocks of every stack (an nn.ModuleList of two or more
    blocks of one class: a decoder's layers, both stacks of an encoder-decoder), outermost
    first; a stack inside a chosen block (an MoE layer's experts) stays part of it. [] if the
    model has none."""
    layers: list = []
    inside: set = set()  # ids of the modules within the blocks chosen so far
    for m in model.modules():
        if id(m) in inside or not _is_stack(m):
            continue
        layers.extend(m)
        inside.update(id(sub) for block in m for sub in block.modules())
    return layers


def layers_to_compile(model: nn.Module, scope: str, where: str) -> list:
    """The layers compile_scope `scope` compiles one by one: repeated_layers(model) under
    "auto" and "layers"; [] under "model", and under "auto" for a model without repeated
    layers (it is compiled whole). Raises ValueError for "layers" on a model without them,
    naming the setting (`where`)."""
    layers = repeated_layers(model) if scope != "model" else []
    if scope == "layers" and not layers:
        raise ValueError(
            f"deepcompile_remat: {where} is \"layers\", but {type(model).__name__} has no "
            "nn.ModuleList of two or more blocks of one class; set \"model\" (or \"auto\") "
            "to compile it whole")
    return layers


def _no_kv_cache_while_training(module, args, kwargs):
    """A transformers model trained with use_cache on (its config's default outside Trainer)
    fills a KV cache no training step reads, and each layer's compiled code guards on its own
    cache entry, so every layer compiles again (up to dynamo's recompile limit, then runs
    eager). In training, unless the caller passes use_cache itself, it is off (as HF's
    gradient checkpointing turns it off)."""
    if module.training and "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    return args, kwargs


def _reads_use_cache(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "use_cache", False) is True and \
        "use_cache" in inspect.signature(model.forward).parameters


def compile_by_layer(model: nn.Module, backend: Callable, unit: bool = True) -> list:
    """Compiles each of `model`'s repeated layers with `backend` (any torch.compile backend:
    dcr.backend(kind, config)) and, with `unit`, makes its sharded parameters outside them one
    eager unit; a transformers model's forward in training gets use_cache=False unless the
    call sets it (_no_kv_cache_while_training). Calling it again with unit=False recompiles
    the layers with the new backend. Returns the layers. Raises ValueError if the model has no
    repeated layers."""
    layers = repeated_layers(model)
    if not layers:
        raise ValueError(f"deepcompile_remat.zero3.compile_by_layer: {type(model).__name__} has no "
                         "nn.ModuleList of two or more blocks of one class; compile it whole")
    for layer in layers:
        layer.compile(backend=backend)
    if unit:
        if owners_outside(model, layers):
            eager_unit(model, exclude=layers)
        if _reads_use_cache(model):
            model.register_forward_pre_hook(_no_kv_cache_while_training, with_kwargs=True)
    return layers
