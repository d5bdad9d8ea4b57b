"""shard(module): ZeRO-3 parameters that torch.compile sees as gathers.

Every parameter is flattened, padded to a multiple of the world size and split; this rank
keeps one slice as an ``nn.Parameter`` (the shard: what the optimizer steps on; its full shape
is ``shard.ds_shape``, as in DeepSpeed). The module's attribute of the same name becomes a
property that returns ``allgather_cast(shard)[:numel].view(shape)``: the traced graph shows the
gather, the partitioner recomputes it in the backward instead of saving the full weight, and a
gathered weight is freed at its last use like any other value. Tied parameters share one shard.

Mixed precision, FSDP2's way (``shard(module, param_dtype=torch.bfloat16)``): the shards stay
in their dtype (fp32: what the optimizer steps on), each floating-point parameter is gathered
already cast to ``param_dtype`` (cast before the gather: half the bytes, no fp32 full weight),
floating-point forward inputs are cast to it, so the whole module computes in it, and each
gradient is reduce-scattered in the shard's dtype (FSDP2's ``MixedPrecisionPolicy(param_dtype,
reduce_dtype=float32)``). Unlike ``torch.autocast``, nothing stays in fp32 inside the model
(layer norms, softmax, the residual stream): fewer casts and smaller activations, with the
numerics of FSDP2's policy rather than autocast's.

Writes go through ``gathered_parameters(module, modifier_rank=...)``: inside it the attributes
are full nn.Parameters (re-init, weight surgery, tying all work as usual), and on exit they are
re-sharded. Outside it a gathered copy refuses writes (zero3/guard.py), since they would be
lost. Assigning one sharded parameter to another attribute (HF-style ``tie_weights``) ties
them: one shard. ``state_dict()`` returns full tensors (gathered: every rank must call it), and
``load_state_dict()`` of full tensors re-shards them.

The group is the data-parallel group: gradients are averaged over exactly its ranks.

Hybrid sharding (FSDP2's HSDP: ``shard(module, mesh=init_device_mesh(..., (replicas,
shard_size)))``, or ``shard(module, group, replicate_group=...)``): parameters are sharded
within the shard group and replicated across the replicate group (the ranks that hold the same
shard on the other replicas: one per replica). Gathers stay within the shard group; each
gradient is reduce-scattered within it and then averaged across the replicate group (one
all-reduce per gradient shard, custom_ops.average_over_replicas), so it is the mean over every
data-parallel rank. The replicas start equal: shard() broadcasts the shards from the first rank
of the replicate group, as DDP does, and gathered_parameters() does the same on exit.

Node-local re-gathers (ZeRO++'s hpZ: ``shard(module, secondary_group=...)``, the secondary group
being this rank's block of k consecutive ranks of the shard group, e.g. its node): the forward
gathers over the shard group as always, and keeps 1/k of each gathered weight that the backward
needs (a secondary shard, in the gathered dtype); the backward re-gathers each weight from the k
secondary shards within the secondary group, so no re-gather leaves the node. The price is
memory: 1/k of every such weight held from the forward to the backward (zero3/passes.py).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from deepcompile_remat.config import RematConfig, check_ranks_agree
from deepcompile_remat.fx_values import OPS
from deepcompile_remat.zero3 import custom_ops  # noqa: F401  (registers OPS.*)
from deepcompile_remat.zero3.guard import GatheredCopy, guard


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is sharded: its full shape and size, this rank's padded shard length,
    the group (by name), and the dtype it is gathered in."""
    shape: tuple
    numel: int
    shard_numel: int  # padded numel / world_size
    world_size: int
    rank: int
    group_name: str
    compute_dtype: Optional[torch.dtype] = None  # gathered in this dtype (shard(param_dtype=))
    # Where the gather runs when the shard lives elsewhere (on the host: DeepSpeed's
    # offload_param under the takeover); None: on the shard's own device.
    device: Optional[torch.device] = None


log = logging.getLogger(__name__)
_SPECS_ATTR = "_dcr_shard_specs"  # set by attach_specs only
_HOOKS_ATTR = "_dcr_state_dict_hooks"
_sharded_classes: dict = {}


def attach_specs(module: nn.Module, specs: dict) -> None:
    """Wires `module`'s sharded parameters to it: name -> ShardSpec. The one place either
    owner of shards (zero3.shard, the DeepSpeed takeover) records which attributes are
    gathers and how; read back with specs_of."""
    object.__setattr__(module, _SPECS_ATTR, specs)


def specs_of(module: nn.Module) -> dict:
    """name -> ShardSpec of `module`'s own sharded parameters ({} when it has none). The dict
    itself, not a copy: tying a parameter updates it in place."""
    return getattr(module, _SPECS_ATTR, {})


def _detach_specs(module: nn.Module) -> None:
    delattr(module, _SPECS_ATTR)


def _gathered(module: nn.Module, name: str, compute: bool = False) -> torch.Tensor:
    """The full parameter; compute=True: in the dtype forward code computes with (param_dtype),
    else in the shard's own (state_dict, gathered_parameters)."""
    spec: ShardSpec = specs_of(module)[name]
    shard = module._parameters[name]
    if shard is None or shard.dim() != 1 or shard.numel() != spec.shard_numel:
        got = None if shard is None else tuple(shard.shape)
        raise RuntimeError(
            f"deepcompile_remat.zero3: parameter {name!r} of {type(module).__name__} changed after "
            f"shard(): expected a 1-D shard of {spec.shard_numel} elements (full shape "
            f"{spec.shape}), found shape {got}. Change parameters inside "
            f"zero3.gathered_parameters(model, modifier_rank=0), or load new weights with "
            f"load_state_dict() (full tensors are re-sharded).")
    return gather(shard, spec, spec.compute_dtype if compute else None)


def gather(shard: torch.Tensor, spec: ShardSpec, dtype: Optional[torch.dtype] = None
           ) -> torch.Tensor:
    """The full parameter from this rank's shard, as a traced gather (shared by every owner of
    shards: zero3.shard and the DeepSpeed takeover); dtype: cast on the way (None: the
    shard's)."""
    if spec.device is not None and shard.device != spec.device:
        # A host-resident shard: copied to the accelerator (its 16-bit partition under
        # DeepSpeed's "bf16"), gathered there; autograd brings its gradient back to the host.
        shard = shard.to(spec.device, non_blocking=True)
    full = OPS.allgather_cast(shard, spec.world_size, spec.group_name, dtype)
    return full[: spec.numel].view(spec.shape)


# On a module while the forward of its eager unit (zero3/eager_unit.py) runs: name -> the full
# parameter the unit gathered with the others, read instead of a gather of its own.
HELD_ATTR = "_dcr_held"
# On a module whose _parameters keep another owner's tensors (the DeepSpeed takeover keeps
# DeepSpeed's): name -> the shard leaf its gathers read. zero3.shard's own shards are the
# _parameters themselves.
SHARDS_ATTR = "_dcr_shards"


def shard_of(module: nn.Module, name: str) -> torch.Tensor:
    """The shard parameter `name` of `module` is gathered from (SHARDS_ATTR, else _parameters)."""
    shards = module.__dict__.get(SHARDS_ATTR)
    return (shards if shards is not None else module._parameters)[name]


def held_copy(module: nn.Module, name: str) -> Optional[torch.Tensor]:
    """The full parameter `name` gathered by `module`'s eager unit while its forward runs
    (eager code only: compiled code gathers its own); None where there is none."""
    held = module.__dict__.get(HELD_ATTR)
    if held is None or name not in held or torch.compiler.is_compiling():
        return None
    return held[name]


def _read_parameter(module: nn.Module, name: str) -> torch.Tensor:
    held = held_copy(module, name)
    if held is not None:
        return guard(held, (module, name))
    full = _gathered(module, name, compute=True)
    if torch.compiler.is_compiling():
        return full
    return guard(full, (module, name))


def _assign_parameter(module: nn.Module, name: str, value) -> None:
    """`module.name = value` for a sharded name: a gathered copy of a sharded parameter ties
    the two (one shard, as HF's tie_weights means); anything else must go through
    gathered_parameters, since each rank holds only its slice."""
    if isinstance(value, GatheredCopy):
        src_module, src_name = value._dcr_source
        src_spec = specs_of(src_module)[src_name]
        if src_spec.shape != specs_of(module)[name].shape:
            raise ValueError(
                f"deepcompile_remat.zero3: cannot tie {name!r} (shape "
                f"{specs_of(module)[name].shape}) to {src_name!r} (shape "
                f"{src_spec.shape}): shapes differ")
        module._parameters[name] = src_module._parameters[src_name]
        specs_of(module)[name] = src_spec
        return
    raise ValueError(
        f"deepcompile_remat.zero3: cannot assign a {type(value).__name__} to "
        f"{type(module)._dcr_unsharded_class.__name__}.{name}, a sharded parameter: each rank holds only its slice. "
        f"Assign inside `with zero3.gathered_parameters(model, modifier_rank=0):` (the new value "
        f"is taken from that rank and re-sharded on exit).")


def _sharded_setattr(self, name, value):
    if name in specs_of(self):
        _assign_parameter(self, name, value)
    else:
        super(type(self), self).__setattr__(name, value)


def sharded_class(cls: type, names: tuple, getter=None) -> type:
    """A subclass of cls whose attributes `names` are properties returning getter(module, name),
    so forward code reading `self.weight` traces a gather. Default getter: zero3.shard's own
    (guarded copies outside compiled code; assignments tie or are refused)."""
    key = (cls, names, getter)
    if key not in _sharded_classes:
        read = _read_parameter if getter is None else getter
        attrs = {n: property(lambda self, n=n: read(self, n)) for n in names}
        if getter is None:
            attrs["__setattr__"] = _sharded_setattr
        attrs["_dcr_unsharded_class"] = cls
        attrs["_dcr_sharded_by_shard"] = getter is None  # else another owner (the takeover)
        _sharded_classes[key] = type(f"Sharded{cls.__name__}", (cls,), attrs)
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


def _served_devices(group) -> set:
    """Device types the group's backend(s) move tensors of: a compound config
    ("cpu:gloo,cuda:nccl") by its device prefixes, a single backend by what it registered."""
    config = str(dist.get_backend_config(group) if hasattr(dist, "get_backend_config")
                 else dist.get_backend(group))
    served = set()
    for part in config.split(","):
        device, _, name = part.strip().rpartition(":")
        served |= {device} if device else set(dist.Backend.backend_capability.get(name.lower(), ()))
    return served


def _check_backend_serves(module: nn.Module, group) -> None:
    """The group's backend must move tensors where the parameters live (CPU: gloo; a CUDA
    parameter: NCCL or gloo). torch's fake backend (emulated worlds) serves any device. Meta
    parameters need no backend: they hold no data, and the dcr ops run their fake kernels on
    them, never a collective (a plan of a step: `deepcompile-remat traffic`)."""
    served = _served_devices(group)
    devices = sorted({p.device.type for p in module.parameters()} - {"meta"})
    missing = [d for d in devices if d not in served]
    if missing:
        raise ValueError(
            f"deepcompile_remat.zero3.shard: the module has parameters on {missing[0]} but the "
            f"process group's backend ({dist.get_backend(group)!r}) cannot move "
            f"{missing[0]} tensors; use a gloo group for cpu (or move the module to the GPU "
            f"first)")


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
    """Whether any submodule has sharded parameters (by zero3.shard or the DeepSpeed
    takeover)."""
    return any(specs_of(m) for m in module.modules())


def _check_group_is_data_parallel(group, group_is_data_parallel: bool,
                                   replicate_group=None) -> None:
    """Gradients are averaged over the group (times the replicate group). Fewer ranks than the
    world is right only if they are the whole data-parallel group; we cannot tell, so the
    caller must say so."""
    size, world = dist.get_world_size(group), dist.get_world_size()
    replicas = 1 if replicate_group is None else dist.get_world_size(replicate_group)
    if size * replicas < world and not group_is_data_parallel:
        what = (f"the process group has {size} of the {world} ranks" if replicas == 1 else
                f"the shard group ({size} ranks) times the replicate group ({replicas}) covers "
                f"{size * replicas} of the {world} ranks")
        raise ValueError(
            f"deepcompile_remat.zero3.shard: {what}. Gradients are averaged over these ranks "
            f"only, which is right only if they are your whole data-parallel group (the other "
            f"ranks hold other model parts, e.g. tensor parallel): then pass "
            f"group_is_data_parallel=True. For hybrid sharding (shard within a group, "
            f"replicate across groups) pass replicate_group= or a 2-D mesh=.")


def _groups_of_mesh(mesh, group, replicate_group):
    """(shard group, replicate group) from shard()'s arguments: a 2-D DeviceMesh is
    (replicate, shard) as FSDP2's HSDP reads it, a 1-D one is the shard group."""
    if mesh is None:
        return group, replicate_group
    if group is not None or replicate_group is not None:
        raise ValueError("deepcompile_remat.zero3.shard: pass either mesh= or group= / "
                         "replicate_group=, not both")
    if mesh.ndim == 1:
        return mesh.get_group(), None
    if mesh.ndim == 2:
        return mesh.get_group(1), mesh.get_group(0)
    raise ValueError(f"deepcompile_remat.zero3.shard: mesh must be 1-D (shard) or 2-D "
                     f"(replicate, shard), got {mesh.ndim} dimensions")


def _check_replicate_group(group, replicate_group) -> None:
    """The replicate group holds this rank and, of its shard group, only this rank: each
    member is another replica of the same shard."""
    if dist.get_rank(replicate_group) < 0:
        raise ValueError("deepcompile_remat.zero3.shard: this rank is not a member of the "
                         "replicate group")
    shared = (set(dist.get_process_group_ranks(group))
              & set(dist.get_process_group_ranks(replicate_group)))
    if shared != {dist.get_rank()}:
        raise ValueError(
            f"deepcompile_remat.zero3.shard: the shard group {dist.get_process_group_ranks(group)}"
            f" and the replicate group {dist.get_process_group_ranks(replicate_group)} share "
            f"ranks {sorted(shared)}; they must share exactly this rank ({dist.get_rank()}): "
            f"the replicate group holds the same shard on every other replica")


def check_secondary_group(group, secondary_group) -> None:
    """The secondary group is this rank's block of k consecutive ranks of the shard group, k
    a proper divisor of its size: then slice i of a gathered weight is what the secondary
    group's rank i keeps, and gathering the k slices in that group's order gives it back."""
    if dist.get_rank(secondary_group) < 0:  # new_group's stand-in for a group without us
        raise ValueError(f"deepcompile_remat.zero3.shard: this rank ({dist.get_rank()}) is not "
                         "a member of the secondary group")
    ranks = dist.get_process_group_ranks(group)
    secondary = dist.get_process_group_ranks(secondary_group)
    k, world = len(secondary), len(ranks)
    where = (f"the shard group {ranks} and the secondary group {secondary} (this rank: "
             f"{dist.get_rank()})")
    if k >= world or world % k:
        raise ValueError(f"deepcompile_remat.zero3.shard: the secondary group's size ({k}) must "
                         f"divide the shard group's ({world}) and be smaller: {where}")
    block = ranks.index(dist.get_rank()) // k
    if ranks[block * k:(block + 1) * k] != secondary:
        raise ValueError(f"deepcompile_remat.zero3.shard: the secondary group must be this "
                         f"rank's block of {k} consecutive ranks of the shard group, "
                         f"{ranks[block * k:(block + 1) * k]}: {where}")


def _replicate(module: nn.Module, group) -> None:
    """Broadcasts every shard from the first rank of the replicate group: the replicas start
    equal, as DDP's do (no-op without replicas)."""
    replicate = custom_ops.replicate_group_of(group)
    if replicate is not None:
        _broadcast_parameters(module, replicate, 0)


def shard(module: nn.Module, group=None, *, replicate_group=None, mesh=None,
          secondary_group=None, config=None, param_dtype: Optional[torch.dtype] = None,
          group_is_data_parallel: bool = False) -> nn.Module:
    """Shards `module`'s parameters in place over `group` (default: WORLD); returns it.

    Hybrid sharding (see the module docstring): replicate_group= the ranks holding the same
    shards on the other replicas, or mesh= a 2-D DeviceMesh (replicate, shard) in place of
    both groups (a 1-D mesh: the shard group).

    Node-local re-gathers (ZeRO++'s hpZ; see the module docstring): secondary_group= this
    rank's block of k consecutive ranks of the shard group (k < its size, dividing it; e.g.
    the ranks of one node: `dist.new_subgroups(k)[0]`). Each compiled forward then keeps
    1/k of every gathered weight the backward needs, and the backward re-gathers within it.

    param_dtype: mixed precision as FSDP2's MixedPrecisionPolicy(param_dtype, reduce_dtype=
    float32) does it (see the module docstring): floating-point parameters are gathered in this
    dtype and floating-point forward inputs cast to it; shards and their gradients keep their
    own dtype. None: parameters are used in their own dtype (with torch.autocast, say).
    group: the data-parallel group; gradients are averaged over its ranks. A group smaller
    than the world needs group_is_data_parallel=True (see _check_group_is_data_parallel).
    config: the RematConfig the module will be compiled with, if you want it checked here.
    Sharding itself reads none of its fields (cast-before-gather, the re-gather schedule and
    prefetch act at compile time, through the backend), but every rank's must be the same
    (ranks that cut or schedule differently hang in mismatched collectives): they are compared,
    and a difference is an error naming the field and the ranks. A config that turns the
    ZeRO-3 marking off would keep every gathered weight alive into the backward: warned."""
    if config is not None:
        if not isinstance(config, RematConfig):
            raise TypeError("deepcompile_remat.zero3.shard: config must be a RematConfig, got "
                            f"{type(config).__name__}")
        if not config.mark_parameter_aliases:
            log.warning("deepcompile_remat.zero3.shard: config.mark_parameter_aliases is False, "
                        "so compiled graphs may save gathered weights for the backward")
    if is_sharded(module):
        raise ValueError("deepcompile_remat.zero3.shard: module is already sharded")
    if param_dtype is not None and not (isinstance(param_dtype, torch.dtype)
                                        and param_dtype.is_floating_point):
        raise TypeError("deepcompile_remat.zero3.shard: param_dtype must be a floating-point "
                        f"torch.dtype (torch.bfloat16, say) or None, got {param_dtype!r}")
    group, replicate_group = _groups_of_mesh(mesh, group, replicate_group)
    group = _resolve_group(group)
    if replicate_group is not None:
        _check_replicate_group(group, replicate_group)
    _check_group_is_data_parallel(group, group_is_data_parallel, replicate_group)
    _check_backend_serves(module, group)
    if secondary_group is not None:
        check_secondary_group(group, secondary_group)
    settings = {"config passed to shard()": config is not None,
                "param_dtype": str(param_dtype),
                "replicas": 1 if replicate_group is None else dist.get_world_size(replicate_group),
                "secondary group size": (0 if secondary_group is None
                                         else dist.get_world_size(secondary_group))}
    if config is not None:
        settings.update({f"RematConfig.{k}": v for k, v in config.as_dict().items()})
    check_ranks_agree(settings, "deepcompile_remat.zero3.shard", group)
    _check_ranks_agree(module, group)
    if replicate_group is not None:
        check_ranks_agree(settings, "deepcompile_remat.zero3.shard", replicate_group)
        _check_ranks_agree(module, replicate_group)
    custom_ops.set_replicate_group(group, replicate_group)
    custom_ops.set_secondary_group(group, secondary_group)
    _shard_modules(module, group, reuse={}, param_dtype=param_dtype)
    _replicate(module, group)
    if param_dtype is not None:
        module.register_forward_pre_hook(_input_cast(param_dtype), with_kwargs=True)
    return module


def _input_cast(dtype: torch.dtype):
    """The root's forward pre-hook under param_dtype: floating-point tensors among the forward's
    arguments are cast to it (FSDP2's cast_forward_inputs), so the first layer computes in it."""
    from torch.utils._pytree import tree_map_only

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    def hook(module, args, kwargs):
        return tree_map_only(torch.Tensor, cast, args), tree_map_only(torch.Tensor, cast, kwargs)

    return hook


def _shard_modules(module: nn.Module, group, reuse: dict,
                   param_dtype: Optional[torch.dtype] = None) -> None:
    """Replaces every full parameter of every submodule by this rank's shard. reuse maps
    id(full parameter) -> the shard it was gathered from: a parameter of unchanged shape and
    dtype is written back into that same shard object (optimizers keep their references).
    param_dtype: what floating-point parameters are gathered as (ShardSpec.compute_dtype)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
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
                mine = flat.view(world, shard_numel)[rank]
                old = reuse.get(id(p))
                if (old is not None and tuple(old.ds_shape) == tuple(p.shape)
                        and old.dtype == p.dtype and old.device == p.device):
                    with torch.no_grad():
                        old.copy_(mine)
                    old.requires_grad_(p.requires_grad)
                    shards[id(p)] = old
                else:
                    new = nn.Parameter(mine.clone(), requires_grad=p.requires_grad)
                    new.ds_shape, new.ds_numel = torch.Size(p.shape), p.numel()
                    shards[id(p)] = new
            compute = param_dtype if p.is_floating_point() and p.dtype != param_dtype else None
            specs[name] = ShardSpec(tuple(p.shape), p.numel(), shard_numel, world, rank,
                                    group.group_name, compute)
            mod._parameters[name] = shards[id(p)]
        attach_specs(mod, specs)
        mod.__class__ = sharded_class(type(mod), names)
        object.__setattr__(mod, _HOOKS_ATTR, (
            mod._register_state_dict_hook(_state_dict_full),
            mod._register_load_state_dict_pre_hook(_load_full, with_module=True)))


def _unshard_modules(module: nn.Module) -> dict:
    """Gathers every shard once into a full nn.Parameter and puts it back on each module
    (tied parameters stay one object); the modules get their own classes back. Returns
    id(full parameter) -> the shard it came from."""
    full_of: dict[int, nn.Parameter] = {}
    shard_of: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        specs = specs_of(mod)
        if not specs:
            continue
        for name in specs:
            shard = mod._parameters[name]
            if id(shard) not in full_of:
                with torch.no_grad():
                    full = _gathered(mod, name).detach().clone()
                full_of[id(shard)] = nn.Parameter(full, requires_grad=shard.requires_grad)
                shard_of[id(full_of[id(shard)])] = shard
        for name in specs:
            mod._parameters[name] = full_of[id(mod._parameters[name])]
        for handle in getattr(mod, _HOOKS_ATTR):
            handle.remove()
        mod.__class__ = type(mod)._dcr_unsharded_class
        _detach_specs(mod)
        delattr(mod, _HOOKS_ATTR)
    return shard_of


def _group_of(module: nn.Module):
    names = {spec.group_name for m in module.modules()
             for spec in specs_of(m).values()}
    if len(names) != 1:
        raise ValueError(f"deepcompile_remat.zero3: expected parameters sharded over one "
                         f"process group, found {len(names)}")
    return custom_ops.resolve_group(names.pop())


def _fingerprints(module: nn.Module) -> list:
    return [(n, hashlib.sha1(p.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
                             .numpy().tobytes()).hexdigest())
            for n, p in module.named_parameters()]


def _broadcast_parameters(module: nn.Module, group, src: int) -> None:
    for p in module.parameters():  # tied parameters once
        data = p.detach().reshape(-1).contiguous()
        flat = data.view(torch.uint8)  # bytes: gloo knows neither bf16 nor every dtype
        dist.broadcast(flat, src=dist.get_global_rank(group, src), group=group)
        with torch.no_grad():
            p.copy_(data.view(p.shape))


@contextlib.contextmanager
def gathered_parameters(module: nn.Module, modifier_rank: Optional[int] = None):
    """Full parameters for writing: inside the block every sharded parameter of `module` is a
    full nn.Parameter again (nn.init, `.data` writes, tie_weights, replacing a parameter by one
    of another shape all work); on exit they are re-sharded. Every rank must enter it.

    modifier_rank: the rank (in the shard group) whose parameters win: they are broadcast to
    every rank on exit (under hybrid sharding, the first replica's win across replicas).
    None: every rank must make the same change, which is checked (a fingerprint of every
    parameter) and an error names the first that differs.
    A parameter whose shape and dtype did not change is written back into its old shard
    object, so optimizers built before keep working; a new or reshaped parameter gets a new
    shard (build the optimizer after)."""
    foreign = sorted({type(m)._dcr_unsharded_class.__name__ for m in module.modules()
                      if specs_of(m) and not type(m)._dcr_sharded_by_shard})
    if foreign:
        raise ValueError(
            f"deepcompile_remat.zero3.gathered_parameters: the parameters of {foreign} were not "
            f"sharded by zero3.shard() (a DeepSpeed engine taken over by "
            f"deepcompile_remat.deepspeed keeps DeepSpeed's own parameters); it works on "
            f"modules sharded by zero3.shard() only")
    group = _group_of(module)
    param_dtype = _param_dtype_of(module)
    shard_of = _unshard_modules(module)
    try:
        yield module
    finally:
        _check_ranks_agree(module, group)
        if modifier_rank is not None:
            _broadcast_parameters(module, group, modifier_rank)
        else:
            mine = _fingerprints(module)
            everyone = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, mine, group=group)
            for r, theirs in enumerate(everyone):
                for (name, a), (_, b) in zip(mine, theirs):
                    if a != b:
                        _shard_modules(module, group, reuse=shard_of, param_dtype=param_dtype)
                        raise ValueError(
                            f"deepcompile_remat.zero3.gathered_parameters: parameter {name!r} "
                            f"differs between this rank and rank {r} of the group after the "
                            f"block; pass modifier_rank= to take one rank's values")
        _shard_modules(module, group, reuse=shard_of, param_dtype=param_dtype)
        _replicate(module, group)


def _param_dtype_of(module: nn.Module) -> Optional[torch.dtype]:
    """The param_dtype the module was sharded with (None: none)."""
    dtypes = {spec.compute_dtype for m in module.modules()
              for spec in specs_of(m).values() if spec.compute_dtype is not None}
    return dtypes.pop() if dtypes else None


def _state_dict_full(mod, state_dict, prefix, local_metadata):
    for name, spec in specs_of(mod).items():
        key = prefix + name
        if key in state_dict:
            state_dict[key] = _gathered(mod, name).detach().clone()
    return state_dict


def _load_full(mod, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    for name, spec in specs_of(mod).items():
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
