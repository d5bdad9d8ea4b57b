"""Eager parameter units: the parameters a sharded model reads outside compiled code, gathered
in one collective when its forward starts and reduce-scattered in one on the way back.

    model = zero3.shard(model)
    for layer in model.model.layers:
        layer.compile(backend=dcr.backend("inductor"))   # torchtitan's way: layers compiled
    zero3.eager_unit(model, exclude=model.model.layers)  # the rest: one unit

Why: with the layers compiled one by one, the rest of the model (embeddings, final norm, head)
runs eagerly, and each of its parameters is gathered when read and reduce-scattered when its
gradient arrives: one collective each way per parameter, 3 + 3 for a Llama where FSDP2's root
unit costs 1 + 1. A unit instead gathers all of them in one dcr::allgather_cast_bucket (a byte
buffer when their dtypes differ) at the module's forward pre-hook, and holds the full copies
until its forward ends, as FSDP2's root unit holds its parameters; reads inside the forward get
the held copies (the same GatheredCopy guard as any eager read). Their gradients leave through
one dcr::reduce_scatter_grad_bucket per shard dtype when autograd has all of them (it calls the
unit's backward once), averaged over the replicas under hybrid sharding, as a single gather's
backward does. A parameter the forward did not use gets no gradient, as before. A shard on the
host (offload_param: ShardSpec.device names the accelerator) is copied over first, cast on the
host where it is gathered narrower, and its gradient, reduced in the shard's dtype on the
accelerator, is returned to the host, as a compiled graph's traced copy does.

Inside compiled code the hooks do nothing: a compiled graph's own schedule buckets its gathers.
Every rank must run the same forward (as for every collective of ZeRO-3).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from deepcompile_remat.fx_values import OPS
from deepcompile_remat.zero3 import custom_ops
from deepcompile_remat.zero3.shard import HELD_ATTR, shard_of, specs_of


def _to_accelerator(shard: torch.Tensor, device, dtype: torch.dtype) -> torch.Tensor:
    """`shard` where its gather runs: a host shard (offload_param: ShardSpec.device) is copied
    over, cast on the host first where it is gathered narrower (half the bytes over the link
    under autocast, as passes.narrow_host_copies does in compiled graphs)."""
    if device is None or shard.device == torch.device(device):
        return shard
    if dtype.itemsize < shard.dtype.itemsize:
        shard = shard.to(dtype)
    return shard.to(device, non_blocking=True)


class _GatherUnit(torch.autograd.Function):
    """Full parameters (flat, padded) of a unit's shards in one collective; the backward
    reduce-scatters their gradients in one per shard dtype, each returned where its shard
    lives (the host, under offload_param)."""

    @staticmethod
    def forward(ctx, world_size: int, group_name: str, dtypes: tuple, devices: tuple, *shards):
        ctx.world_size, ctx.group_name = world_size, group_name
        ctx.shard_dtypes = [s.dtype for s in shards]
        ctx.shard_devices = [s.device for s in shards]
        ctx.set_materialize_grads(False)  # an unused parameter gets no gradient
        moved = [_to_accelerator(s, d, t) for s, d, t in zip(shards, devices, dtypes)]
        return tuple(OPS.allgather_cast_bucket(
            moved, world_size, group_name,
            **custom_ops.bucket_kwargs([m.dtype for m in moved], dtypes)))

    @staticmethod
    def backward(ctx, *grads):
        shard_grads = [None] * len(grads)
        by_dtype: dict = {}  # one buffer per reduce-scatter bucket: one dtype each
        for i, (g, dtype) in enumerate(zip(grads, ctx.shard_dtypes)):
            if g is not None:
                by_dtype.setdefault(dtype, []).append(i)
        for dtype, members in by_dtype.items():
            reduced = OPS.reduce_scatter_grad_bucket(
                [grads[i].to(dtype).contiguous() for i in members], ctx.world_size,
                ctx.group_name)
            for i, g in zip(members, reduced):
                g = custom_ops.average_over_replicas(g, ctx.group_name)
                shard_grads[i] = g.to(ctx.shard_devices[i], non_blocking=True)
        return (None, None, None, None, *shard_grads)


def owners_outside(module: nn.Module, exclude: Iterable[nn.Module]) -> list:
    """(owner module, parameter name) of every sharded parameter of `module` outside the
    excluded subtrees."""
    excluded = {id(m) for e in exclude for m in e.modules()}
    return [(m, name) for m in module.modules() if id(m) not in excluded
            for name in specs_of(m)]


def eager_unit(module: nn.Module, exclude: Iterable[nn.Module] = ()) -> nn.Module:
    """Makes the sharded parameters of `module` outside `exclude` (the compiled layers, say)
    one unit, gathered together when `module`'s forward starts and held until it ends (module
    docstring). Returns `module`. Raises ValueError if `module` holds no such parameter or
    they are sharded over different groups."""
    exclude = [exclude] if isinstance(exclude, nn.Module) else list(exclude)
    owners = owners_outside(module, exclude)
    if not owners:
        raise ValueError(f"deepcompile_remat.zero3.eager_unit: {type(module).__name__} holds no "
                         "sharded parameter outside `exclude` (is it zero3.shard()ed?)")
    groups = {(specs_of(m)[n].group_name, specs_of(m)[n].world_size) for m, n in owners}
    if len(groups) != 1:
        raise ValueError(f"deepcompile_remat.zero3.eager_unit: the unit's parameters are sharded "
                         f"over {len(groups)} groups; a unit gathers over one")
    (group_name, world_size), = groups

    def gather(mod, args, kwargs):
        if torch.compiler.is_compiling():
            return None
        shards, index = [], {}  # tied parameters: one shard, gathered once
        for m, name in owners:
            shard = shard_of(m, name)
            if id(shard) not in index:
                index[id(shard)] = len(shards)
                shards.append((shard, specs_of(m)[name]))
        dtypes = tuple(spec.compute_dtype or shard.dtype for shard, spec in shards)
        devices = tuple(spec.device for _, spec in shards)
        fulls = _GatherUnit.apply(world_size, group_name, dtypes, devices,
                                  *(s for s, _ in shards))
        for m, name in owners:
            spec = specs_of(m)[name]
            full = fulls[index[id(shard_of(m, name))]]
            held = m.__dict__.setdefault(HELD_ATTR, {})
            held[name] = full[: spec.numel].view(spec.shape)
        return None

    def release(mod, args, kwargs, output):
        for m, _ in owners:
            m.__dict__.pop(HELD_ATTR, None)
        return None

    module.register_forward_pre_hook(gather, with_kwargs=True)
    module.register_forward_hook(release, with_kwargs=True, always_call=True)
    return module

