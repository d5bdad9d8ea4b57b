"""shard(module): ZeRO-3 parameters that torch.compile sees as gathers.

Every parameter is flattened, padded to a multiple of the world size and split; this rank
keeps one slice as an fp32 ``nn.Parameter`` (the shard: what the optimizer steps on). The
module's attribute of the same name becomes a property that returns
``allgather_cast(shard)[:numel].view(shape)``: the traced graph shows the gather, the
partitioner recomputes it in the backward instead of saving the full weight, and a gathered
weight is freed at its last use like any other value. Tied parameters share one shard.

``state_dict()`` returns full tensors (gathered: every rank must call it), and
``load_state_dict()`` of full tensors re-shards them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from deepcompile_remat.zero3 import ops  # noqa: F401  (registers torch.ops.dcr.*)


@dataclass(frozen=True)
class ShardSpec:
    shape: tuple
    numel: int
    shard_numel: int  # padded numel / world_size
    world_size: int
    rank: int
    group_name: str


log = logging.getLogger(__name__)
_SPECS_ATTR = "_dcr_shard_specs"
_sharded_classes: dict = {}


def _gathered(module: nn.Module, name: str) -> torch.Tensor:
    spec: ShardSpec = getattr(module, _SPECS_ATTR)[name]
    shard = module._parameters[name]
    if shard is None or shard.dim() != 1 or shard.numel() != spec.shard_numel:
        got = None if shard is None else tuple(shard.shape)
        raise RuntimeError(
            f"deepcompile_remat.zero3: parameter {name!r} of {type(module).__name__} changed after "
            f"shard(): expected a 1-D shard of {spec.shard_numel} elements (full shape "
            f"{spec.shape}), found shape {got}. Load new weights with load_state_dict() (full "
            f"tensors are re-sharded), not by assigning parameters.")
    full = torch.ops.dcr.allgather_cast(shard, spec.world_size, spec.group_name)
    return full[: spec.numel].view(spec.shape)


def _sharded_class(cls: type, names: tuple) -> type:
    key = (cls, names)
    if key not in _sharded_classes:
        props = {n: property(lambda self, n=n: _gathered(self, n)) for n in names}
        _sharded_classes[key] = type(f"Sharded{cls.__name__}", (cls,), props)
    return _sharded_classes[key]


def _resolve_group(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "deepcompile_remat.zero3.shard: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group() first (world size 1 is fine)")
    group = group if group is not None else dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise ValueError("deepcompile_remat.zero3.shard: this rank is not a member of the given "
                         "process group")
    return group


def _check_backend_serves(module: nn.Module, group) -> None:
    """The group's backend must move tensors where the parameters live (CPU: gloo)."""
    backend = str(dist.get_backend(group)).lower()
    devices = sorted({p.device.type for p in module.parameters()})
    if "cpu" in devices and "gloo" not in backend and "mpi" not in backend:
        raise ValueError(
            f"deepcompile_remat.zero3.shard: the module has parameters on cpu but the process "
            f"group's backend is {backend!r}, which cannot gather cpu tensors; use a gloo group "
            f"(or move the module to the GPU first)")


def _check_ranks_agree(module: nn.Module, group) -> None:
    """Every rank must shard the same parameters with the same shapes, or the gathers hang."""
    layout = [(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    world = dist.get_world_size(group)
    everyone = [None] * world
    dist.all_gather_object(everyone, layout, group=group)
    ranks = dist.get_process_group_ranks(group)
    for r, theirs in enumerate(everyone):
        if theirs == layout:
            continue
        for i, (mine, other) in enumerate(zip(layout, theirs)):
            if mine != other:
                raise ValueError(
                    f"deepcompile_remat.zero3.shard: ranks disagree on parameter #{i}: this rank "
                    f"(global {dist.get_rank()}) has {mine}, global rank {ranks[r]} has {other}")
        raise ValueError(
            f"deepcompile_remat.zero3.shard: this rank has {len(layout)} parameters, global rank "
            f"{ranks[r]} has {len(theirs)}")


def is_sharded(module: nn.Module) -> bool:
    return any(hasattr(m, _SPECS_ATTR) for m in module.modules())


def shard(module: nn.Module, group=None, *, config=None) -> nn.Module:
    """Shards `module`'s parameters in place over `group` (default: WORLD); returns it.

    config: the RematConfig the module will be compiled with, if you want it checked here.
    Sharding itself reads none of its fields (cast-before-gather, the re-gather schedule and
    prefetch act at compile time, through the backend), but a config that turns the ZeRO-3
    marking off would keep every gathered weight alive into the backward: that is warned."""
    if config is not None:
        from deepcompile_remat.config import RematConfig

        if not isinstance(config, RematConfig):
            raise TypeError("deepcompile_remat.zero3.shard: config must be a RematConfig, got "
                            f"{type(config).__name__}")
        if not config.mark_parameter_aliases:
            log.warning("deepcompile_remat.zero3.shard: config.mark_parameter_aliases is False, "
                        "so compiled graphs may save gathered weights for the backward")
    if is_sharded(module):
        raise ValueError("deepcompile_remat.zero3.shard: module is already sharded")
    group = _resolve_group(group)
    _check_backend_serves(module, group)
    _check_ranks_agree(module, group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    group_name = group.group_name
    shards: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        names = tuple(n for n, p in mod._parameters.items() if p is not None)
        if not names:
            continue
        specs = {}
        for name in names:
            p = mod._parameters[name]
            shard_numel = -(-p.numel() // world)
            if id(p) not in shards:
                flat = torch.zeros(shard_numel * world, dtype=p.dtype, device=p.device)
                flat[: p.numel()] = p.detach().reshape(-1)
                shards[id(p)] = nn.Parameter(flat.view(world, shard_numel)[rank].clone(),
                                             requires_grad=p.requires_grad)
            specs[name] = ShardSpec(tuple(p.shape), p.numel(), shard_numel, world, rank, group_name)
            mod._parameters[name] = shards[id(p)]
        object.__setattr__(mod, _SPECS_ATTR, specs)
        mod.__class__ = _sharded_class(type(mod), names)
        mod._register_state_dict_hook(_state_dict_full)
        mod._register_load_state_dict_pre_hook(_load_full, with_module=True)
    return module


def _state_dict_full(mod, state_dict, prefix, local_metadata):
    for name, spec in getattr(mod, _SPECS_ATTR).items():
        key = prefix + name
        if key in state_dict:
            state_dict[key] = _gathered(mod, name).detach().clone()
    return state_dict


def _load_full(mod, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    for name, spec in getattr(mod, _SPECS_ATTR).items():
        key = prefix + name
        if key not in state_dict:
            continue
        full = state_dict[key]
        if tuple(full.shape) != spec.shape:
            raise ValueError(
                f"deepcompile_remat.zero3: {key} has shape {tuple(full.shape)} in the state dict, "
                f"but the sharded parameter is {spec.shape}")
        flat = torch.zeros(spec.shard_numel * spec.world_size, dtype=full.dtype, device=full.device)
        flat[: spec.numel] = full.reshape(-1)
        state_dict[key] = flat.view(spec.world_size, -1)[spec.rank].clone()
