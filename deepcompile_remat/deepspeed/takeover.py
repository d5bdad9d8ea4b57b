"""take_over(engine, settings): a stock DeepSpeed ZeRO-3 engine, parameters handled by us.

After deepspeed.initialize every parameter is a DeepSpeed ZeRO-3 parameter: an empty
placeholder whose rank-local slice lives in ``param.ds_tensor`` (1-D, padded, in the dtype
DeepSpeed keeps: bf16 under "bf16", fp32 under "torch_autocast"). The takeover

  1. removes DeepSpeed's gather/release and gradient hooks (_ds_internals.remove_zero3_hooks)
     and frees what only they used, if anything (the engine was built with none of it:
     its gradient reduce buckets, 3 GB at its default reduce_bucket_size under torch_autocast,
     are not allocated, config.DeepSpeedSettings.deepspeed_config; under torch_autocast its
     fp32 partitions were created as the aliases of the parameter partitions DeepSpeed meant
     them to be, _ds_internals.fp32_partitions_created_as_aliases, not copies);
  2. gives each parameter one *shard leaf*: an ``nn.Parameter`` aliasing ds_tensor's storage,
     so the optimizer's in-place updates of ds_tensor are what the next forward gathers;
  3. turns each module attribute into a property returning ``gather(leaf)`` (zero3.shard's
     traced allgather_cast, [:numel].view(shape)); ``module._parameters`` keeps DeepSpeed's
     parameters, so named_parameters(), state_dict() and checkpoints are DeepSpeed's own;
  4. compiles with our backend, as the block's compile_scope says: by default each repeated
     layer on its own, the rest of the model one eager unit (zero3.compile_by_layer), else
     the module's whole forward; the partitioner sees the gathers and re-gathers in the
     backward instead of saving full weights.

Gradients: allgather_cast's backward reduce-scatters the full gradient (mean over ranks, as
DeepSpeed's averaging), so each shard leaf receives exactly this rank's averaged partition. A
post-accumulate-grad hook hands it to DeepSpeed's gradient partition the way partition_grads
does (replace on the first micro-batch after a step, add on the next ones). Where DeepSpeed's
step allows (bf16 and torch_autocast with an elementwise torch optimizer, or any optimizer under
optimizer offload), the slot *is* that gradient: no flat gradient buffer exists, and the step
reads each parameter's gradient in place. Elsewhere it is copied into DeepSpeed's flat buffer,
which then exists only from the first gradient of a backward to the end of the optimizer step.
Under optimizer offload ("offload_optimizer": {"device": "cpu"}) DeepSpeed's fp32 master, its
gradients and the optimizer states live on the host and DeepSpeed steps them there; at the
accumulation boundary the hook sends each gradient partition to the host as the backward
produces it (DeepSpeed's own copy and norm) and frees its slot, so no gradient of the whole
shard is staged on the accelerator; the forward gathers DeepSpeed's parameter partitions,
which its step rewrites from the host master. Under parameter offload ("offload_param":
{"device": "cpu"}, with or without the optimizer offloaded) the leaves are DeepSpeed's 16-bit
partitions on the host: each gather copies its shard to the accelerator first (half the bytes
where it casts to 16 bits: zero3/passes.py, narrow_host_copies), and each gradient arrives on
the host, where an offloaded optimizer reads it; with the optimizer on the accelerator it goes
back there to DeepSpeed's slot (Takeover.grad_device): one more copy of a gradient partition
over the host link than stock DeepSpeed, whose reduce-scatter writes the slot in place.
The engine's own backward epilogue then runs unchanged (empty reduce buckets): optimizer
step, clipping, overflow checks and checkpoints read the partitions as they always do.

What the takeover reads of the config is its DeepSpeedSettings (config.py); every patch it makes
to DeepSpeed (methods of the optimizer and engine, flags, hook handles, engine.dcr_takeover) is
made by the Takeover's DeepSpeedAdapter (adapter.py), after adapter.check_engine, and undone by
engine.destroy() or uninstall(): Takeover.end() first gives DeepSpeed its data back in its own
layout, and a forward after it raises. The model's own modules (their class, forward and shard
leaves) stay as the takeover made them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from deepcompile_remat.config import RematConfig
from deepcompile_remat.deepspeed import _ds_internals as ds
from deepcompile_remat.deepspeed.adapter import (DeepSpeedAdapter, check_deepspeed,
                                                 stage3_optimizer_class)
from deepcompile_remat.deepspeed.config import DeepSpeedSettings
from deepcompile_remat.deepspeed.optimizer_step import hold_gradients_only_in_the_step
from deepcompile_remat.zero3 import custom_ops
from deepcompile_remat.zero3.layers import compile_by_layer, layers_to_compile
from deepcompile_remat.zero3.shard import (SHARDS_ATTR, ShardSpec, attach_specs,
                                          check_secondary_group, gather, held_copy, shard_of,
                                          sharded_class, specs_of)

log = logging.getLogger(__name__)


def _gathered(module: nn.Module, name: str) -> torch.Tensor:
    """The full parameter `name` of a taken-over module: its shard leaf, gathered (cast on the
    way where the leaf is the fp32 master of a 16-bit parameter)."""
    held = held_copy(module, name)  # gathered with the rest of an eager unit
    if held is not None:
        return held
    spec = specs_of(module)[name]
    return gather(shard_of(module, name), spec, spec.compute_dtype)


@dataclass(repr=False)
class Takeover:
    """What initialize() attached to the engine (engine.dcr_takeover): the DeepSpeed settings
    it was taken over with (settings; the block's config is settings.remat), the adapter that
    made and records every patch of DeepSpeed (adapter; engine.destroy() and uninstall() undo
    it, end() first), the backend kind compiling the module now (kind), one (DeepSpeed
    parameter, shard leaf) pair per parameter taken over (leaves; tied parameters share one),
    and the bytes of DeepSpeed's buffers it released (released_bytes: the unused gradient
    reduce buckets, and under torch_autocast the fp32 partitions DeepSpeed copied where it
    meant to alias the parameter partitions; _ds_internals.alias_fp32_partitions). Under
    "bf16" (and "fp16") the leaves are slices of DeepSpeed's fp32 master and its 16-bit
    parameter partitions are dropped (sixteen_bit: _ds_internals.SixteenBitPartitions);
    per_parameter_gradients says whether DeepSpeed's gradient slots are the backward's own
    tensors (no flat buffer). Its repr is one line: ``Takeover(backend='inductor',
    parameters=24, released_bytes=0, gathers_from_master=False)``."""

    settings: DeepSpeedSettings
    adapter: DeepSpeedAdapter
    kind: str = ""  # the backend kind the module's forward is compiled with now
    scope: str = ""  # what is compiled: "layers" (each repeated layer) or "model" (compile_scope)
    leaves: list = field(default_factory=list)  # (DeepSpeed parameter, shard leaf)
    written: set = field(default_factory=set)  # ds_ids whose slot this micro-batch has written
    handles: list = field(default_factory=list)
    released_bytes: int = 0  # DeepSpeed's reduce buckets and duplicate fp32 partitions
    released_fp32_bytes: int = 0  # of which duplicate fp32 partitions
    # "bf16"/"fp16": the leaves are the fp32 master, DeepSpeed's 16-bit partitions dropped
    sixteen_bit: Optional[ds.SixteenBitPartitions] = None
    optimizer: Any = None
    # ds.master_slices, and the masters' storages they were taken from (sync redoes them only
    # when DeepSpeed moved a master: offload/reload_states)
    masters: dict = field(default_factory=dict)
    masters_at: tuple = ()
    # Whether DeepSpeed's gradient slots are the backward's own gradients (no flat buffer)
    per_parameter_gradients: bool = False
    # offload_optimizer "cpu": each gradient partition leaves for the host at the boundary
    offloads: bool = False
    # offload_param "cpu": the leaves (DeepSpeed's 16-bit partitions) live on the host
    offloads_parameters: bool = False
    # offload_param without offload_optimizer: a leaf's gradient arrives on the host, and goes
    # to this device (the accelerator, beside the fp32 master) where DeepSpeed's step reads it
    grad_device: Optional[torch.device] = None
    # Parameters whose DeepSpeed secondary partitions (hpZ: zero_hpz_partition_size) are dropped
    hpz_params: list = field(default_factory=list)
    # Whether end() ran (engine.destroy() or uninstall()): the engine cannot train any more
    ended: bool = False

    @property
    def remat(self) -> RematConfig:
        """The "deepcompile_remat" block the engine was taken over with."""
        return self.settings.remat

    def __repr__(self) -> str:
        return (f"Takeover(backend={self.kind!r}, parameters={len(self.leaves)}, "
                f"released_bytes={self.released_bytes}, "
                f"gathers_from_master={self.sixteen_bit is not None})")

    def summary(self) -> str:
        """The line rank 0 logs at takeover."""
        buckets = self.released_bytes - self.released_fp32_bytes
        scope = ("each repeated layer compiled on its own, the rest one eager unit"
                 if self.scope == "layers" else "the whole forward compiled")
        # The build allocates neither (DeepSpeedSettings.deepspeed_config,
        # _ds_internals.fp32_partitions_created_as_aliases): a release is news.
        released = (f"; released {self.released_bytes / 2**20:.1f} MiB: "
                    f"{buckets / 2**20:.1f} of DeepSpeed's unused gradient reduce buckets, "
                    f"{self.released_fp32_bytes / 2**20:.1f} of fp32 partitions copied from "
                    f"the fp32 parameter partitions (now aliases)"
                    if self.released_bytes else "")
        return (f"deepcompile_remat: took over {len(self.leaves)} DeepSpeed ZeRO-3 parameters "
                f"(backend {self.kind}; {scope}){released}"
                + (f"; gathers from the fp32 master weights, DeepSpeed's 16-bit parameter "
                   f"partitions ({self.sixteen_bit.nbytes / 2**20:.1f} MiB) dropped"
                   if self.sixteen_bit is not None else ""))

    def end(self) -> None:
        """Gives DeepSpeed its data back in its own layout (the 16-bit partitions, the flat
        gradient buffer) and removes the shard leaves' gradient hooks; the adapter then undoes
        every patch (registered with adapter.before_undo: engine.destroy() and uninstall() run
        it). A forward after it raises."""
        self.ended = True
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.sixteen_bit is not None:
            self.sixteen_bit.bring_back()
        ds.restore_grad_partitions(self.optimizer)

    def sync(self) -> None:
        """Before each forward: re-point a leaf whose partition DeepSpeed moved to new storage
        (offload_states / reload_states, a checkpoint load that reallocates): the leaf must
        alias the live slice (of ds_tensor, or of the fp32 master); and drop the 16-bit
        partitions again if something of DeepSpeed's brought them back."""
        if self.sixteen_bit is not None:
            at = tuple(m.data_ptr() for m in self.optimizer.fp32_partitioned_groups_flat)
            if at != self.masters_at:
                self.masters, self.masters_at = ds.master_slices(self.optimizer), at
        for p, leaf in self.leaves:
            t = self.masters.get(p.ds_id, p.ds_tensor)
            if (leaf.data_ptr() != t.data_ptr() or leaf.dtype != t.dtype
                    or leaf.numel() != t.numel()):
                leaf.data = t.data
        if self.sixteen_bit is not None:
            self.sixteen_bit.drop()
        for p in self.hpz_params:  # DeepSpeed re-partitions after its own gathers (hpZ)
            p.ds_secondary_tensor = None


def check_supported(engine, settings: DeepSpeedSettings) -> None:
    """What the takeover does not implement, refused before anything is touched: the settings
    initialize() already refused from the config, read again from the engine, which may have
    them from elsewhere (an mpu, DeepSpeed's defaults), and an optimizer that is not ZeRO-3's;
    and an engine whose hpZ differs from the config's (the settings the takeover reads)."""
    problems = []
    if type(engine.optimizer) is not stage3_optimizer_class():  # MiCS subclasses it
        problems.append(f"the engine's optimizer is {type(engine.optimizer).__name__}, not "
                        "DeepSpeed's ZeRO-3 optimizer (pass an optimizer or an \"optimizer\" "
                        "block; inference-only engines and MiCS are not supported)")
    in_engine = DeepSpeedSettings.from_engine(engine, settings.remat)
    problems += in_engine.unsupported()
    if in_engine.zero_hpz_partition_size != settings.zero_hpz_partition_size:
        problems.append(f"the engine's {DeepSpeedSettings.key('zero_hpz_partition_size')} is "
                        f"{in_engine.zero_hpz_partition_size!r}, the config's "
                        f"{settings.zero_hpz_partition_size!r} ({settings.where})")
    if problems:
        raise ValueError("deepcompile_remat: cannot take over this DeepSpeed engine: "
                         + "; ".join(problems))


def _spec(p, compute_dtype=None, device=None) -> ShardSpec:
    group = p.ds_process_group if p.ds_process_group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shard_numel = p.ds_tensor.numel()
    if p.ds_tensor.dim() != 1 or shard_numel * world < p.ds_numel:
        raise RuntimeError(
            f"deepcompile_remat: DeepSpeed parameter ds_id={p.ds_id} (shape {tuple(p.ds_shape)}) "
            f"has a partition of shape {tuple(p.ds_tensor.shape)} on {world} ranks: not the 1-D "
            f"padded partition the takeover expects")
    return ShardSpec(tuple(p.ds_shape), p.ds_numel, shard_numel, world, rank, group.group_name,
                     compute_dtype, device)


def _grad_hook(takeover: Takeover, optimizer, p, spec: ShardSpec):
    # A partition wholly in the padding (tiny parameters on many ranks): DeepSpeed leaves its
    # gradient slot untouched (partition_grads), and so do we.
    holds_data = spec.rank * spec.shard_numel < spec.numel

    @torch.no_grad()
    def hook(leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        if grad is None or not holds_data:
            return
        # Where the slot is read: the accelerator under offload_param alone, else where the
        # gradient arrived. Moved and cast in one copy, where the slot is filled.
        device = takeover.grad_device or grad.device
        # DeepSpeed's rule (partition_grads): the first micro-batch after a step replaces the
        # slot, the next ones (and a second use in this one) add to it.
        again = p.ds_id in takeover.written  # a second gradient in this micro-batch
        replace = not again and ds.micro_step_id(optimizer) == 0
        takeover.written.add(p.ds_id)
        if takeover.per_parameter_gradients:
            slot = ds.grad_partition(optimizer, p)
            if slot.device.type == "meta" and again and takeover.offloads:
                slot = ds.host_grad_partition(optimizer, p).to(device)  # sent already
            if replace or slot.device.type == "meta":
                slot = grad.to(device, slot.dtype)
                ds.set_grad_partition(optimizer, p, slot)  # kept, not copied
            else:
                slot.add_(grad.to(device, slot.dtype))
        else:
            ds.restore_grad_partitions(optimizer)  # freed since the last step: back, zeroed
            slot = ds.grad_partition(optimizer, p).narrow(0, 0, grad.numel())
            if replace:
                slot.copy_(grad)
            else:
                slot.add_(grad.to(device, slot.dtype))
        if takeover.offloads:
            _to_host_at_boundary(takeover, optimizer, p, slot)

    return hook


def _to_host_at_boundary(takeover: Takeover, optimizer, p, slot: torch.Tensor) -> None:
    """Optimizer offload: at the accumulation boundary the gradient partition leaves for the
    host as the backward produces it (DeepSpeed's own copy into the fp32 gradient its step
    reads, and the norm its clipping reads), and a per-parameter slot is freed at once: no
    gradient of the whole shard is ever staged on the accelerator. Before the boundary the
    slot keeps accumulating on the accelerator, as DeepSpeed's does."""
    if not ds.at_accumulation_boundary(optimizer):
        ds.keep_for_boundary(optimizer, p)
        return
    ds.send_grad_to_host(optimizer, p, slot)
    if takeover.per_parameter_gradients:
        ds.set_grad_partition(optimizer, p, torch.empty_like(slot, device="meta"))


def requested_kind(backend: Any) -> Optional[str]:
    """Our backend kind for what engine.compile(backend=...) names: "inductor" is inductor,
    "eager" and "aot_eager" (AOTAutograd, FX graphs run as they are) are our eager; anything
    else (a callable, cudagraphs, ...) has no counterpart: None."""
    if isinstance(backend, str):
        return {"inductor": "inductor", "eager": "eager", "aot_eager": "eager"}.get(backend)
    return None


def _engine_compile(takeover: Takeover, compile_forward):
    """engine.compile on a taken-over engine (what Trainer/Accelerate call for torch_compile):
    the module is compiled already, with our backend. A request for another backend is
    honoured when the block leaves "backend" unset (takeover.remat.backend is None) and ours
    has that kind; otherwise it is refused with a warning that says which backend runs and
    why."""

    def compile(backend=None, compile_kwargs=None, **_ignored):  # noqa: A001
        kind = requested_kind(backend) if backend is not None else takeover.kind
        info = log.info if dist.get_rank() == 0 else log.debug  # one line per job
        if kind == takeover.kind:
            info("deepcompile_remat: engine.compile(backend=%r): the module is compiled "
                 "with deepcompile_remat's %s backend already", backend, kind)
        elif takeover.remat.backend is not None:
            log.warning("deepcompile_remat: engine.compile(backend=%r) not honoured: the "
                        "\"deepcompile_remat\" block sets \"backend\": %r, which compiles the "
                        "module (remove it from the block to let engine.compile choose)",
                        backend, takeover.remat.backend)
        elif kind is None:
            log.warning("deepcompile_remat: engine.compile(backend=%r) not honoured: "
                        "deepcompile_remat compiles the module with its own partitioner, on "
                        "\"inductor\" or \"eager\" (aot_eager) only; it stays on %r",
                        backend, takeover.kind)
        else:
            compile_forward(kind)
            info("deepcompile_remat: engine.compile(backend=%r): the module is compiled "
                 "with deepcompile_remat's %s backend", backend, kind)
        if compile_kwargs:
            info("deepcompile_remat: engine.compile's compile_kwargs %s are not used",
                 sorted(compile_kwargs))

    return compile


def _regather_within_hpz_groups(module, settings: DeepSpeedSettings) -> list:
    """ZeRO++'s hpZ (settings.zero_hpz_partition_size > 1) as our node-local re-gathers: each
    parameter's data-parallel group re-gathers in the backward within DeepSpeed's hpZ group
    (zero3.shard(secondary_group=) semantics: a secondary shard kept from the forward to the
    backward only); an hpZ group of the whole data-parallel group (hpZ >= its size) re-gathers
    as without hpZ. DeepSpeed's own secondary partitions, which it keeps between steps and its
    gathers (now ours) would read, are dropped. Returns the parameters that had an hpZ group."""
    params = []
    for name, p in module.named_parameters():
        secondary = getattr(p, "ds_zero_param_process_group", None)
        if (secondary is not None) != settings.hpz:
            raise RuntimeError(
                f"deepcompile_remat: {settings.where}: "
                f"{DeepSpeedSettings.key('zero_hpz_partition_size')} is "
                f"{settings.zero_hpz_partition_size!r}, but DeepSpeed gave parameter {name!r} "
                f"{'an' if secondary is not None else 'no'} hpZ group (built under a "
                "deepspeed.zero.Init with another config?)")
        if secondary is None:
            continue
        group = p.ds_process_group if p.ds_process_group is not None else dist.group.WORLD
        if (dist.get_world_size(secondary) < dist.get_world_size(group)
                and custom_ops.secondary_group_of(group) is not secondary):
            check_secondary_group(group, secondary)
            custom_ops.set_secondary_group(group, secondary)
        p.ds_secondary_tensor = None
        params.append(p)
    return params


def _check_parameters(module) -> None:
    for name, p in module.named_parameters():
        if not hasattr(p, "ds_tensor"):
            raise RuntimeError(f"deepcompile_remat: parameter {name!r} is not a DeepSpeed ZeRO-3 "
                               "parameter (added after deepspeed.initialize?)")


def _master_slices(module, optimizer) -> dict:
    """"bf16"/"fp16": ds_id -> the parameter's slice of the fp32 master, which its leaf
    becomes (gathered with a cast to 16 bits, as our own runtime's param_dtype); {} where the
    takeover cannot gather from the master (_ds_internals.can_gather_from_master)."""
    masters = ds.master_slices(optimizer) if ds.can_gather_from_master(optimizer) else {}
    for name, p in module.named_parameters():
        if p.ds_id in masters and not torch.equal(masters[p.ds_id].to(p.ds_tensor.dtype),
                                                  p.ds_tensor):
            raise RuntimeError(
                f"deepcompile_remat: parameter {name!r}: DeepSpeed's fp32 master partition is not "
                "where the takeover expects it (its 16-bit partition is not its cast); "
                "_ds_internals.master_slices no longer matches this DeepSpeed")
    return masters


def _start(engine, settings: DeepSpeedSettings) -> Takeover:
    """Checks (what the takeover does not implement; every DeepSpeed attribute it uses, on
    classes and on this engine), then DeepSpeed's hooks removed and what only they used
    released; the Takeover, its adapter ending it on engine.destroy()."""
    check_supported(engine, settings)
    check_deepspeed()  # done by initialize() already, before the engine was built
    adapter = DeepSpeedAdapter("the takeover")
    adapter.check_engine(engine)  # before the first patch
    module, optimizer = engine.module, engine.optimizer
    _check_parameters(module)
    ds.remove_zero3_hooks(engine, adapter)
    ds.release_gathered_parameters(engine, adapter)
    released = ds.release_reduce_buckets(optimizer)
    released_fp32 = ds.alias_fp32_partitions(optimizer)
    takeover = Takeover(settings, adapter, released_bytes=released + released_fp32,
                        released_fp32_bytes=released_fp32, optimizer=optimizer)
    adapter.before_undo(takeover.end)
    adapter.undo_on_destroy(engine)
    return takeover


def _attach_leaves(takeover: Takeover, module, masters: dict) -> None:
    """One shard leaf per parameter (tied ones share it), each module's attributes
    properties gathering them (zero3.shard.sharded_class), each leaf's gradient handed to
    DeepSpeed's slot by a post-accumulate-grad hook."""
    leaves: dict = {}
    # offload_param: the leaves stay on the host, each gather copies its shard over first
    device = ds.accelerator_device() if takeover.offloads_parameters else None
    for mod in module.modules():
        names = tuple(n for n, p in mod._parameters.items() if p is not None)
        if not names:
            continue
        mod_leaves, specs = {}, {}
        for n in names:
            p = mod._parameters[n]
            master = masters.get(p.ds_id)
            spec = _spec(p, p.ds_tensor.dtype if master is not None else None, device)
            if id(p) not in leaves:
                leaves[id(p)] = _leaf(takeover, p, master, spec)
            mod_leaves[n], specs[n] = leaves[id(p)], spec
        object.__setattr__(mod, SHARDS_ATTR, mod_leaves)  # _parameters keep DeepSpeed's
        attach_specs(mod, specs)
        mod.__class__ = sharded_class(type(mod), names, _gathered)


def _leaf(takeover: Takeover, p, master, spec: ShardSpec) -> nn.Parameter:
    leaf = nn.Parameter(master if master is not None else p.ds_tensor.data,
                        requires_grad=p.requires_grad)
    takeover.leaves.append((p, leaf))
    if p.requires_grad:
        takeover.handles.append(leaf.register_post_accumulate_grad_hook(
            _grad_hook(takeover, takeover.optimizer, p, spec)))
    return leaf


def _before_each_forward(takeover: Takeover):
    def before_forward(_module, _args):
        if takeover.ended:
            raise RuntimeError(
                "deepcompile_remat: this engine's takeover was ended (engine.destroy() or "
                "deepcompile_remat.deepspeed.uninstall()); DeepSpeed's own hooks were removed "
                "when it was taken over, so it cannot train: build a new engine")
        takeover.sync()
        takeover.written.clear()  # a new micro-batch

    return before_forward


def _compile(engine, takeover: Takeover) -> None:
    """The module compiled with our backend, as compile_scope says: each repeated layer on its
    own and the rest one eager unit (zero3/layers.py), or the whole forward (only the forward:
    the pre-hook stays eager); engine.compile answers what Trainer/Accelerate ask of it
    (_engine_compile)."""
    from deepcompile_remat.backends import backend

    module, remat = engine.module, takeover.remat
    forward = module.forward
    layers = layers_to_compile(module, remat.compile_scope,
                               f"{takeover.settings.where}.compile_scope")
    takeover.scope = "layers" if layers else "model"

    def compile_forward(kind: str) -> None:
        if layers:  # the eager unit once; a recompile (engine.compile) changes the backend only
            compile_by_layer(module, backend(kind, remat), unit=not takeover.kind)
        else:
            module.forward = torch.compile(forward, backend=backend(kind, remat))
        takeover.kind = kind

    compile_forward(remat.backend_kind)
    takeover.adapter.replace(engine, "compile", _engine_compile(takeover, compile_forward))


def take_over(engine, settings: DeepSpeedSettings) -> Takeover:
    """Puts a stock ZeRO-3 engine's parameters under our traced gathers and compiles its
    module's forward with our backend (module docstring), every patch of DeepSpeed made by
    one DeepSpeedAdapter (undone by engine.destroy() and uninstall()); returns what was
    attached (also engine.dcr_takeover)."""
    takeover = _start(engine, settings)
    try:
        _take_over_started(engine, takeover)
    except BaseException:
        takeover.adapter.undo()  # no patch outlives a takeover that failed half-way
        raise
    if dist.get_rank() == 0:  # one line per job, not per rank
        log.info("%s", takeover.summary())
    return takeover


def _take_over_started(engine, takeover: Takeover) -> None:
    module, optimizer, adapter = engine.module, engine.optimizer, takeover.adapter
    masters = _master_slices(module, optimizer)
    if masters:
        takeover.sixteen_bit = ds.SixteenBitPartitions(
            optimizer, [p for p in module.parameters() if p.ds_id in masters], adapter)
    takeover.per_parameter_gradients = hold_gradients_only_in_the_step(
        optimizer, takeover.sixteen_bit, adapter)
    takeover.offloads = ds.offloads_gradients(optimizer)
    takeover.offloads_parameters = ds.offloads_parameters(optimizer)
    if takeover.offloads_parameters and not takeover.offloads:
        takeover.grad_device = ds.gradient_device(optimizer)
    takeover.hpz_params = _regather_within_hpz_groups(module, takeover.settings)
    _attach_leaves(takeover, module, masters)
    module.register_forward_pre_hook(_before_each_forward(takeover))
    if takeover.sixteen_bit is not None:
        takeover.sixteen_bit.drop()
    _compile(engine, takeover)
    adapter.add(engine, "dcr_takeover", takeover)
