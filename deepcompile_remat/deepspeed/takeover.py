"""take_over(engine, remat): a stock DeepSpeed ZeRO-3 engine, parameters handled by us.

After deepspeed.initialize every parameter is a DeepSpeed ZeRO-3 parameter: an empty
placeholder whose rank-local slice lives in ``param.ds_tensor`` (1-D, padded, in the dtype
DeepSpeed keeps: bf16 under "bf16", fp32 under "torch_autocast"). The takeover

  1. removes DeepSpeed's gather/release and gradient hooks (_ds_internals.remove_zero3_hooks)
     and frees what only they used (its preallocated gradient reduce buckets, 3 GB at its
     default reduce_bucket_size under torch_autocast), and under torch_autocast makes its fp32
     partitions the aliases of the parameter partitions DeepSpeed meant them to be (it copies
     them: 4 bytes per parameter);
  2. gives each parameter one *shard leaf*: an ``nn.Parameter`` aliasing ds_tensor's storage,
     so the optimizer's in-place updates of ds_tensor are what the next forward gathers;
  3. turns each module attribute into a property returning ``gather(leaf)`` (zero3.shard's
     traced allgather_cast, [:numel].view(shape)); ``module._parameters`` keeps DeepSpeed's
     parameters, so named_parameters(), state_dict() and checkpoints are DeepSpeed's own;
  4. compiles the module's forward with our backend: the partitioner sees the gathers and
     re-gathers in the backward instead of saving full weights.

Gradients: allgather_cast's backward reduce-scatters the full gradient (mean over ranks, as
DeepSpeed's averaging), so each shard leaf receives exactly this rank's averaged partition. A
post-accumulate-grad hook hands it to DeepSpeed's gradient partition the way partition_grads
does (replace on the first micro-batch after a step, add on the next ones). Where DeepSpeed's
step allows (bf16 and torch_autocast with an elementwise torch optimizer, no offload), the
slot *is* that gradient: no flat gradient buffer exists, and the step reads each parameter's
gradient in place. Elsewhere it is copied into DeepSpeed's flat buffer, which then exists only
from the first gradient of a backward to the end of the optimizer step. The engine's own
backward epilogue then runs unchanged (empty reduce buckets): optimizer step, clipping,
overflow checks and checkpoints read the partitions as they always do.
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
from deepcompile_remat.deepspeed.config import unsupported_by_takeover
from deepcompile_remat.zero3 import custom_ops
from deepcompile_remat.zero3.shard import (ShardSpec, attach_specs, check_secondary_group, gather,
                                          sharded_class, specs_of)

log = logging.getLogger(__name__)
# The shard leaves each module gathers from (name -> leaf); _parameters keeps DeepSpeed's own.
_LEAVES_ATTR = "_dcr_ds_leaves"


def _gathered(module: nn.Module, name: str) -> torch.Tensor:
    """The full parameter `name` of a taken-over module: its shard leaf, gathered (cast on the
    way where the leaf is the fp32 master of a 16-bit parameter)."""
    spec = specs_of(module)[name]
    return gather(getattr(module, _LEAVES_ATTR)[name], spec, spec.compute_dtype)


@dataclass(repr=False)
class Takeover:
    """What initialize() attached to the engine (engine.dcr_takeover): the block's config
    (remat), the backend kind compiling the module now (kind), one (DeepSpeed parameter, shard
    leaf) pair per parameter taken over (leaves; tied parameters share one), and the bytes of
    DeepSpeed's buffers it released (released_bytes: the unused gradient reduce buckets, and
    under torch_autocast the fp32 partitions DeepSpeed copied where it meant to alias the
    parameter partitions; _ds_internals.alias_fp32_partitions). Under "bf16" (and "fp16")
    the leaves are slices of DeepSpeed's fp32 master and its 16-bit parameter partitions are
    dropped (sixteen_bit: _ds_internals.SixteenBitPartitions); per_parameter_gradients says
    whether DeepSpeed's gradient slots are the backward's own tensors (no flat buffer). Its
    repr is one line: ``Takeover(backend='inductor', parameters=24, released_bytes=0,
    gathers_from_master=False)``."""

    remat: RematConfig
    kind: str = ""  # the backend kind the module's forward is compiled with now
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
    # Parameters whose backward re-gathers within DeepSpeed's hpZ group (zero_hpz_partition_size)
    hpz_params: list = field(default_factory=list)

    def __repr__(self) -> str:
        return (f"Takeover(backend={self.kind!r}, parameters={len(self.leaves)}, "
                f"released_bytes={self.released_bytes}, "
                f"gathers_from_master={self.sixteen_bit is not None})")

    def summary(self) -> str:
        """The line rank 0 logs at takeover."""
        buckets = self.released_bytes - self.released_fp32_bytes
        return (f"deepcompile_remat: took over {len(self.leaves)} DeepSpeed ZeRO-3 parameters "
                f"(backend {self.kind}); released {self.released_bytes / 2**20:.1f} MiB: "
                f"{buckets / 2**20:.1f} of DeepSpeed's unused gradient reduce buckets, "
                f"{self.released_fp32_bytes / 2**20:.1f} of fp32 partitions copied from the "
                f"fp32 parameter partitions (now aliases)"
                + (f"; gathers from the fp32 master weights, DeepSpeed's 16-bit parameter "
                   f"partitions ({self.sixteen_bit.nbytes / 2**20:.1f} MiB) dropped"
                   if self.sixteen_bit is not None else ""))

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


def check_supported(engine) -> None:
    """What the takeover does not implement, refused before anything is touched: the settings
    initialize() already refused from the config (read again from the engine, which may have
    them from elsewhere: an mpu, DeepSpeed's defaults), and an optimizer that is not ZeRO-3's."""
    problems = []
    if type(engine.optimizer) is not ds.stage3_optimizer_class():  # MiCS subclasses it
        problems.append(f"the engine's optimizer is {type(engine.optimizer).__name__}, not "
                        "DeepSpeed's ZeRO-3 optimizer (pass an optimizer or an \"optimizer\" "
                        "block; inference-only engines and MiCS are not supported)")
    problems += unsupported_by_takeover({
        "zero_optimization.offload_optimizer": getattr(engine.zero_offload_optimizer(), "device",
                                                       None),
        "zero_optimization.offload_param": getattr(engine.zero_offload_param(), "device", None),
        "zero_optimization.zero_hpz_partition_size": engine.zero_hpz_partition_size(),
        "gradient_predivide_factor": engine.gradient_predivide_factor(),
        "sequence_parallel_size": getattr(engine, "sequence_parallel_size", 1)})
    if problems:
        raise ValueError("deepcompile_remat: cannot take over this DeepSpeed engine: "
                         + "; ".join(problems))


def _spec(p, compute_dtype=None) -> ShardSpec:
    group = p.ds_process_group if p.ds_process_group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shard_numel = p.ds_tensor.numel()
    if p.ds_tensor.dim() != 1 or shard_numel * world < p.ds_numel:
        raise RuntimeError(
            f"deepcompile_remat: DeepSpeed parameter ds_id={p.ds_id} (shape {tuple(p.ds_shape)}) "
            f"has a partition of shape {tuple(p.ds_tensor.shape)} on {world} ranks: not the 1-D "
            f"padded partition the takeover expects")
    return ShardSpec(tuple(p.ds_shape), p.ds_numel, shard_numel, world, rank, group.group_name,
                     compute_dtype)


def _grad_hook(takeover: Takeover, optimizer, p, spec: ShardSpec):
    # A partition wholly in the padding (tiny parameters on many ranks): DeepSpeed leaves its
    # gradient slot untouched (partition_grads), and so do we.
    holds_data = spec.rank * spec.shard_numel < spec.numel

    @torch.no_grad()
    def hook(leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        if grad is None or not holds_data:
            return
        # DeepSpeed's rule (partition_grads): the first micro-batch after a step replaces the
        # slot, the next ones (and a second use in this one) add to it.
        replace = p.ds_id not in takeover.written and ds.micro_step_id(optimizer) == 0
        takeover.written.add(p.ds_id)
        if takeover.per_parameter_gradients:
            slot = ds.grad_partition(optimizer, p)
            if replace or slot.device.type == "meta":
                ds.set_grad_partition(optimizer, p, grad.to(slot.dtype))  # kept, not copied
            else:
                slot.add_(grad.to(slot.dtype))
            return
        ds.restore_grad_partitions(optimizer)  # freed since the last step: back, zeroed
        slot = ds.grad_partition(optimizer, p).narrow(0, 0, grad.numel())
        if replace:
            slot.copy_(grad)
        else:
            slot.add_(grad.to(slot.dtype))

    return hook


def _hold_gradients_only_in_the_step(optimizer, sixteen_bit) -> bool:
    """DeepSpeed holds its flat gradient buffer for the whole run, copies it once more in the
    optimizer step (flatten), and the backward's gradients are copied into it, so at the end
    of a backward both exist. Here, where DeepSpeed's step allows it
    (_ds_internals.reads_gradients_per_parameter), there is no flat buffer: each slot is the
    gradient the backward produced, read by the step in place and freed after it. Elsewhere
    the buffer exists from the first gradient a backward writes until the optimizer step that
    reads it. Either way the step holds no copy it does not read
    (_ds_internals.step_without_copies): what our own runtime holds. Anything else that reads
    the buffer (offload_states) gets it back first, holding the gradients written so far.
    Returns whether gradients are per parameter."""
    per_parameter = ds.reads_gradients_per_parameter(optimizer)
    step_ended = ds.step_without_copies(optimizer, per_parameter, sixteen_bit)
    step, offload_states = optimizer.step, getattr(optimizer, "offload_states", None)
    epilogue = optimizer.independent_gradient_partition_epilogue

    def before_reading():
        if per_parameter:
            ds.fill_unwritten_grad_partitions(optimizer)  # unused parameters: zeros
        else:
            ds.restore_grad_partitions(optimizer)  # a step with no backward reads zeros

    def epilogue_reading_every_slot(*args, **kwargs):
        before_reading()
        result = epilogue(*args, **kwargs)
        if sixteen_bit is not None:
            ds.zeros_for_placeholders(optimizer)  # frozen parameters' zeros_like(ds_tensor)
        return result

    def step_then_release(*args, **kwargs):
        before_reading()
        try:
            return step(*args, **kwargs)
        finally:
            step_ended()
            ds.release_grad_partitions(optimizer)

    optimizer.step = step_then_release
    optimizer.independent_gradient_partition_epilogue = epilogue_reading_every_slot
    if offload_states is not None:
        def restore_then_offload(*args, **kwargs):
            ds.restore_grad_partitions(optimizer)
            return offload_states(*args, **kwargs)

        optimizer.offload_states = restore_then_offload
    ds.release_grad_partitions(optimizer)
    return per_parameter


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


def _regather_within_hpz_groups(module) -> list:
    """ZeRO++'s hpZ (zero_hpz_partition_size > 1) as our node-local re-gathers: each
    parameter's data-parallel group re-gathers in the backward within DeepSpeed's hpZ group
    (zero3.shard(secondary_group=) semantics: a secondary shard kept from the forward to the
    backward only). DeepSpeed's own secondary partitions, which it keeps between steps and its
    gathers (now ours) would read, are dropped. Returns the parameters that had an hpZ group."""
    params = []
    for p in module.parameters():
        secondary = getattr(p, "ds_zero_param_process_group", None)
        if secondary is None:
            continue
        group = p.ds_process_group if p.ds_process_group is not None else dist.group.WORLD
        if custom_ops.secondary_group_of(group) is not secondary:
            check_secondary_group(group, secondary)
            custom_ops.set_secondary_group(group, secondary)
        p.ds_secondary_tensor = None
        params.append(p)
    return params


def take_over(engine, remat: RematConfig) -> Takeover:
    """Puts a stock ZeRO-3 engine's parameters under our traced gathers and compiles its
    module's forward with our backend (module docstring); returns what was attached."""
    from deepcompile_remat.backends import backend

    check_supported(engine)
    module, optimizer = engine.module, engine.optimizer
    for name, p in module.named_parameters():
        if not hasattr(p, "ds_tensor"):
            raise RuntimeError(f"deepcompile_remat: parameter {name!r} is not a DeepSpeed ZeRO-3 "
                               "parameter (added after deepspeed.initialize?)")
    ds.remove_zero3_hooks(engine)
    ds.release_gathered_parameters(engine)
    released = ds.release_reduce_buckets(optimizer)
    released_fp32 = ds.alias_fp32_partitions(optimizer)

    # "bf16"/"fp16": each leaf is the parameter's slice of the fp32 master, gathered with a
    # cast to 16 bits (as our own runtime's param_dtype), and the 16-bit partitions dropped.
    masters = ds.master_slices(optimizer) if ds.can_gather_from_master(optimizer) else {}
    for name, p in module.named_parameters():
        if p.ds_id in masters and not torch.equal(masters[p.ds_id].to(p.ds_tensor.dtype),
                                                  p.ds_tensor):
            raise RuntimeError(
                f"deepcompile_remat: parameter {name!r}: DeepSpeed's fp32 master partition is not "
                "where the takeover expects it (its 16-bit partition is not its cast); "
                "_ds_internals.master_slices no longer matches this DeepSpeed")
    sixteen_bit = (ds.SixteenBitPartitions(optimizer, [p for p in module.parameters()
                                                       if p.ds_id in masters])
                   if masters else None)
    takeover = Takeover(remat, released_bytes=released + released_fp32,
                        released_fp32_bytes=released_fp32, sixteen_bit=sixteen_bit,
                        optimizer=optimizer)
    takeover.per_parameter_gradients = _hold_gradients_only_in_the_step(optimizer, sixteen_bit)
    takeover.hpz_params = _regather_within_hpz_groups(module)
    leaves: dict = {}
    for mod in module.modules():
        names = tuple(n for n, p in mod._parameters.items() if p is not None)
        if not names:
            continue
        mod_leaves, specs = {}, {}
        for n in names:
            p = mod._parameters[n]
            master = masters.get(p.ds_id)
            spec = _spec(p, p.ds_tensor.dtype if master is not None else None)
            if id(p) not in leaves:  # tied parameters share one leaf
                leaf = nn.Parameter(master if master is not None else p.ds_tensor.data,
                                    requires_grad=p.requires_grad)
                leaves[id(p)] = leaf
                takeover.leaves.append((p, leaf))
                if p.requires_grad:
                    takeover.handles.append(leaf.register_post_accumulate_grad_hook(
                        _grad_hook(takeover, optimizer, p, spec)))
            mod_leaves[n], specs[n] = leaves[id(p)], spec
        object.__setattr__(mod, _LEAVES_ATTR, mod_leaves)
        attach_specs(mod, specs)
        mod.__class__ = sharded_class(type(mod), names, _gathered)

    def before_forward(_module, _args):
        takeover.sync()
        takeover.written.clear()  # a new micro-batch

    takeover.handles.append(module.register_forward_pre_hook(before_forward))
    if sixteen_bit is not None:
        sixteen_bit.drop()
    # Only forward is compiled: the hook above stays eager.
    forward = module.forward

    def compile_forward(kind: str) -> None:
        module.forward = torch.compile(forward, backend=backend(kind, remat))
        takeover.kind = kind

    compile_forward(remat.backend_kind)
    engine.compile = _engine_compile(takeover, compile_forward)
    if dist.get_rank() == 0:  # one line per job, not per rank
        log.info("%s", takeover.summary())
    return takeover
