"""What the takeover does with DeepSpeed's internals (read from deepspeed 0.19.8): the hooks it
removes, the data it frees, re-points and brings back (buffers, gradient slots, 16-bit
partitions). Every patch of a DeepSpeed attribute goes through the DeepSpeedAdapter these
functions are given (adapter.py, which also lists every attribute used and checks each exists
before the takeover starts); data is not patched but handled here, and given back in
DeepSpeed's layout when the takeover ends (takeover.Takeover.end).

What DeepSpeed would do without us, and what replaces it (compare deepspeed/compile/init_z3.py,
which takes over ZeRO-3 the same way for DeepCompile):
  - module hooks (parameter_offload._remove_module_hooks): gather before each submodule's
    forward, release after; replaced by traced gathers of ds_tensor.
  - the engine's forward pre/post hooks: mark every module "_in_forward", which makes a
    parameter read through module._parameters all-gather it; removed (as DeepCompile does).
  - grad-accumulation hooks (optimizer._grad_acc_hooks) and leaf-module hooks: bucket, reduce-
    scatter and copy grads into the grad partitions; replaced by our reduce-scatter in the
    compiled backward and write_grad_partition below.
  - ZeRO's F.linear replacement (zero3_linear_wrap, an autograd.Function that saves the
    gathered weight); torch's F.linear restored, as init_z3 does.
  - persistent parameters (kept gathered between steps); released and no longer re-gathered.
  - the gradient reduce buckets (optimizer.ipg_buckets[dtype].buffer, preallocated at
    reduce_bucket_size): unused without its gradient hooks; shrunk to nothing.
  - under torch_autocast, the fp32 partitions (fp32_partitioned_groups_flat) DeepSpeed copies
    from the fp32 parameter partitions by mistake: made the aliases it meant them to be.
"""
from __future__ import annotations

import logging

import torch

from deepcompile_remat.deepspeed.adapter import (GRAD_PARTITION_MAP,
                                                 OPTIMIZER_METHODS_READING_16BIT,
                                                 PARAMETER_METHODS_READING_16BIT,
                                                 DeepSpeedAdapter, stage3_optimizer_class)
from deepcompile_remat.deepspeed.chunked_step import ELEMENTWISE

log = logging.getLogger(__name__)


def remove_zero3_hooks(engine, adapter: DeepSpeedAdapter) -> None:
    """DeepSpeed's gather/release module hooks, its gradient hooks and the engine's forward
    hooks, all removed (the engine's handles set to None, as DeepCompile does: recorded);
    torch's F.linear in place of DeepSpeed's zero3_linear_wrap (shared by every takeover in
    the process: adapter.share)."""
    optimizer = engine.optimizer
    optimizer.parameter_offload._remove_module_hooks()
    for hooks in (optimizer._grad_acc_hooks, optimizer._leaf_module_hooks):
        for hook in hooks:
            hook.remove()
        hooks.clear()
    for attr in ("module_forward_pre_hook", "module_forward_post_hook"):
        handle = getattr(engine, attr)
        if handle is not None:
            handle.remove()
            adapter.replace(engine, attr, None)
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    torch_linear = getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", None)
    if torch_linear is not None:  # set when DeepSpeed put its own linear in place
        adapter.share(torch.nn.functional, "linear", torch_linear)


def release_gathered_parameters(engine, adapter: DeepSpeedAdapter) -> None:
    """Partition any parameter DeepSpeed holds gathered (persistent ones, small by
    stage3_param_persistence_threshold) and stop it re-gathering them after each step (each
    ds_persist false, the optimizer's persistent_parameters an empty list: recorded): from
    now on every use reads the shard."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for p in engine.module.parameters():
        if p.ds_persist:
            adapter.replace(p, "ds_persist", False)
        if p.ds_status == ZeroParamStatus.AVAILABLE:
            p.partition()
    adapter.replace(engine.optimizer, "persistent_parameters", [])  # _post_step gathers these


def release_reduce_buckets(optimizer) -> int:
    """DeepSpeed's gradient reduce buckets (IPG buckets: a contiguous buffer of
    reduce_bucket_size elements per communication dtype, 5e8 by default: 2 GB fp32 plus 1 GB
    bf16 under torch_autocast) serve only its gradient hooks, which the takeover removes:
    shrink each to 0 elements (not None, so offload_states/reload_states keep working).
    Returns the bytes released."""
    released = 0
    for bucket in optimizer.ipg_buckets.values():
        buffer = getattr(bucket, "buffer", None)
        if buffer is None or buffer.numel() == 0:
            continue
        if bucket.params:
            raise RuntimeError("deepcompile_remat: DeepSpeed's reduce bucket holds gradients; "
                               "take over before the first backward")
        released += buffer.numel() * buffer.element_size()
        bucket.buffer = buffer.new_empty(0)
    return released


def fp32_partitions_created_as_aliases(adapter: DeepSpeedAdapter):
    """Context manager for the engine build: while it is open, DeepSpeed's ZeRO-3 optimizer
    creates its fp32 partitions with its device as a torch.device instead of a string, so its
    own test for "the parameter partitions are fp32 already" (alias_fp32_partitions) holds and
    it makes the aliases it means to, never the copies the takeover would free after the build
    (4 bytes per parameter under torch_autocast), where master_beside_parameter_partitions.
    Recorded by `adapter`, put back on exit."""
    stage3 = stage3_optimizer_class()
    create = stage3._create_fp32_partitions

    def create_fp32_partitions(self, *args, **kwargs):
        named = self.device
        if isinstance(named, str) and master_beside_parameter_partitions(self):
            self.device = torch.device(named)
        try:
            return create(self, *args, **kwargs)
        finally:
            self.device = named

    return adapter.replaced(stage3, "_create_fp32_partitions", create_fp32_partitions)


def master_beside_parameter_partitions(optimizer) -> bool:
    """Whether DeepSpeed's fp32 master and its parameter partitions belong on one device, so
    that under torch_autocast one may alias the other: neither is offloaded (an offloaded one
    belongs on the host; on a CPU accelerator it only looks like the same device)."""
    return not optimizer.offload_optimizer and not optimizer.offload_param


def alias_fp32_partitions(optimizer) -> int:
    """Under torch_autocast the parameter partitions are fp32 already, and DeepSpeed means its
    fp32 (master) partitions to be those same tensors (stage3._create_fp32_partitions: "we
    don't need another copy of the weights"). Its test compares a tensor's device with the
    accelerator's device *name*, a string, which never equals a torch.device in torch 2.x, so
    it makes a copy: 4 more bytes per parameter held for the whole run. Make each fp32
    partition that is an equal copy of its parameter partition (same dtype, device and values)
    share that partition's storage, as DeepSpeed intended: the optimizer updates the parameter
    partitions in place and DeepSpeed's copy back after the step (fp16 <- fp32) copies a tensor
    onto itself. A checkpoint load writes through the alias (fp32_partitioned_groups_flat[i]
    .data.copy_). Only where master_beside_parameter_partitions. Returns the bytes released."""
    released = 0
    if not master_beside_parameter_partitions(optimizer):
        return 0
    for lp, hp in zip(optimizer.fp16_partitioned_groups_flat,
                      optimizer.fp32_partitioned_groups_flat):
        if (hp is lp or hp.dtype != lp.dtype or hp.device != lp.device or hp.shape != lp.shape
                or hp.untyped_storage().data_ptr() == lp.untyped_storage().data_ptr()
                or not torch.equal(hp, lp)):
            continue
        released += hp.untyped_storage().nbytes()
        hp.data = lp.data
    return released


def reads_gradients_per_parameter(optimizer) -> bool:
    """Whether DeepSpeed's optimizer step can read each parameter's gradient partition as a
    tensor of its own (the one the backward produced) instead of a slot of the flat gradient
    buffer: everything it reads in the step either takes a list of tensors (the norm for
    clipping: averaged_gradients) or is replaced by optimizer_step.StepWithoutCopies (the
    fp32 gradient, the clipping's scaling, the torch optimizer's step). Under optimizer offload
    the step reads the host's fp32 gradients and the norms recorded as they left
    (send_grad_to_host), never a slot: per parameter too, whatever the optimizer. Not where
    something reads the flat buffer itself or the sub-group's flat fp32 gradient: fp16 (its
    overflow check), DeepSpeed's torch_autocast grad scaler, ZenFlow, Muon, a torch optimizer
    not known to be elementwise (without offload)."""
    if optimizer.dtype == torch.float16 or not _plain_step(optimizer):
        return False
    return offloads_gradients(optimizer) or type(optimizer.optimizer) in ELEMENTWISE


def _plain_step(optimizer) -> bool:
    return not (optimizer.torch_autocast_gradscaler or optimizer.zenflow or optimizer.use_muon)


def offloads_gradients(optimizer) -> bool:
    """Whether DeepSpeed's optimizer lives on the host (offload_optimizer "cpu"): its fp32
    master, the fp32 gradients its step reads and its states; the takeover sends each
    gradient partition there at the accumulation boundary (send_grad_to_host)."""
    return bool(optimizer.offload_optimizer) and not getattr(optimizer, "swap_optimizer", False)


def offloads_parameters(optimizer) -> bool:
    """Whether DeepSpeed keeps the 16-bit parameter partitions on the host (offload_param
    "cpu"): each ds_tensor is a slice of fp16_partitioned_groups_flat there."""
    return bool(optimizer.offload_param)


def gradient_device(optimizer) -> torch.device:
    """Where DeepSpeed's gradient slots live and its step reads them: beside the fp32 master
    (the accelerator, or the host under optimizer offload)."""
    return optimizer.fp32_partitioned_groups_flat[0].device


def accelerator_device() -> torch.device:
    """DeepSpeed's accelerator device for this rank (where gathers run)."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def at_accumulation_boundary(optimizer) -> bool:
    """Whether this backward ends a gradient accumulation window (the engine sets it before
    engine.backward: "managed" accumulation); in the engine's "unmanaged" mode it turns true
    only inside engine.step, whose finalize_gradient_accumulation_boundary then sends what
    keep_for_boundary marked."""
    return optimizer.is_gradient_accumulation_boundary()


def send_grad_to_host(optimizer, param, grad: torch.Tensor) -> None:
    """DeepSpeed's own boundary work for one gradient partition under offload
    (_offload_grad_partition_at_boundary): its norm recorded for clipping, and a non-blocking
    copy (cast to fp32) into the host's fp32 gradient the step reads. `param` is then no
    longer owed to the boundary."""
    optimizer._offload_grad_partition_at_boundary(param, grad, {}, {})
    optimizer._offload_boundary_param_ids.discard(param.ds_id)


def keep_for_boundary(optimizer, param) -> None:
    """`param`'s slot holds gradient not yet sent to the host: DeepSpeed's
    finalize_gradient_accumulation_boundary sends it (unmanaged mode), or the backward at the
    boundary does (managed)."""
    optimizer._offload_boundary_param_ids.add(param.ds_id)


def host_grad_partition(optimizer, param) -> torch.Tensor:
    """The host's fp32 gradient of `param` under offload (its span of the sub-group's
    fp32_partitioned_groups_flat[i].grad): what send_grad_to_host wrote."""
    sub_group, offset, _ = optimizer.grad_position[optimizer.get_param_id(param)]
    flat = optimizer.fp32_partitioned_groups_flat[sub_group].grad
    return flat.narrow(0, offset, param.partition_numel())


def steps_the_torch_optimizer_itself(optimizer) -> bool:
    """Whether DeepSpeed's _optimizer_step is a plain torch optimizer.step() on the sub-group's
    flat fp32 tensor, which optimizer_step.StepWithoutCopies may replace by a step over views
    of it: not under optimizer offload, DeepSpeed's torch_autocast grad scaler, ZenFlow or Muon."""
    return not optimizer.offload_optimizer and _plain_step(optimizer)


def can_gather_from_master(optimizer) -> bool:
    """Whether the takeover can gather each parameter from DeepSpeed's fp32 master partition
    (cast to 16 bits on the way) and drop the 16-bit parameter partitions: "bf16" or "fp16"
    (16-bit partitions derived from the master, lp_param_buffer), master and partitions on one
    device (no optimizer offload, no NVMe-swapped sub-group)."""
    lp = getattr(optimizer, "lp_param_buffer", None)
    masters = optimizer.fp32_partitioned_groups_flat
    return (lp is not None and not optimizer.offload_optimizer and lp.dtype != masters[0].dtype
            and all(m is not None and m.device == lp.device for m in masters)
            and all(f is not None for f in optimizer.fp16_partitioned_groups_flat))


def master_slices(optimizer) -> dict:
    """ds_id -> this rank's slice of the fp32 master partition holding that parameter, laid
    out as DeepSpeed lays the 16-bit partitions it copies from them (the parameters of
    fp16_groups in order, partition_numel each)."""
    slices = {}
    for sub_group, params in enumerate(optimizer.fp16_groups):
        master, offset = optimizer.fp32_partitioned_groups_flat[sub_group], 0
        for p in params:
            slices[p.ds_id] = master.narrow(0, offset, p.partition_numel())
            offset += p.partition_numel()
    return slices


class SixteenBitPartitions:
    """DeepSpeed's 16-bit parameter partitions (lp_param_buffer; each parameter's ds_tensor a
    view of it: 2 bytes per parameter under "bf16") while the takeover gathers from the fp32
    master: nothing of the takeover's forward, backward or step reads them, so they are
    dropped, and brought back (rewritten from the master, as DeepSpeed's step would have left
    them) for the DeepSpeed code that does read them (adapter.OPTIMIZER_METHODS_READING_16BIT and
    PARAMETER_METHODS_READING_16BIT), until the next
    forward drops them again. While dropped each parameter's ds_tensor is a meta tensor of the
    same shape and attributes, so a read of its values is torch's meta-device error, never
    freed memory. A write to them while they are back (GatheredParameters with modifier_rank:
    stock DeepSpeed would overwrite it from the master at its next step) is copied into the
    master when they are dropped, with a warning: training continues from what was written."""

    def __init__(self, optimizer, params, adapter: DeepSpeedAdapter):
        self.optimizer, self.params = optimizer, list(params)
        self.buffer = optimizer.lp_param_buffer
        self.nbytes = self.buffer.numel() * self.buffer.element_size()
        self._originals: dict = {}  # ds_id -> DeepSpeed's ds_tensor, while dropped
        for name in OPTIMIZER_METHODS_READING_16BIT:
            adapter.wrap(optimizer, name, self._brought_back_first)
        for p in self.params:
            for name in PARAMETER_METHODS_READING_16BIT:
                adapter.wrap(p, name, self._brought_back_first)

    @property
    def dropped(self) -> bool:
        """Whether the 16-bit partitions are dropped now (meta placeholders in ds_tensor)."""
        return bool(self._originals)

    def _brought_back_first(self, method):
        """`method`, called once the 16-bit partitions are back."""

        def brought_back_first(*args, **kwargs):
            self.bring_back()
            return method(*args, **kwargs)

        return brought_back_first

    def drop(self) -> None:
        """Frees the 16-bit partitions (a write made to them since bring_back is first copied
        into the master); each ds_tensor becomes a meta placeholder. No-op when dropped."""
        if self.dropped:
            return
        self._keep_writes()
        for p in self.params:
            t = p.ds_tensor
            placeholder = torch.empty_like(t, device="meta")
            placeholder.__dict__.update(t.__dict__)  # ds_numel, status, ... (metadata readers)
            self._originals[p.ds_id] = t
            p.ds_tensor = placeholder
        release_storage(self.buffer)

    def bring_back(self) -> None:
        """The 16-bit partitions back, rewritten from the fp32 master, and each ds_tensor
        DeepSpeed's own again. No-op when they are there."""
        if not self.dropped:
            return
        restore_storage(self.buffer)
        optimizer = self.optimizer
        for sub_group, flat in enumerate(optimizer.fp16_partitioned_groups_flat):
            flat.data.copy_(optimizer.fp32_partitioned_groups_flat[sub_group].data)
        for p in self.params:
            p.ds_tensor = self._originals.pop(p.ds_id)

    @torch.no_grad()
    def _keep_writes(self) -> None:
        written = 0
        for flat, master in zip(self.optimizer.fp16_partitioned_groups_flat,
                                self.optimizer.fp32_partitioned_groups_flat):
            changed = flat != master.to(flat.dtype)
            count = int(changed.sum())
            if count:
                master[changed] = flat[changed].to(master.dtype)
                written += count
        if written:
            log.warning("deepcompile_remat: %d elements of DeepSpeed's 16-bit parameter "
                        "partitions were written outside training (GatheredParameters with "
                        "modifier_rank?); copied into the fp32 master weights the takeover "
                        "trains from (stock DeepSpeed would overwrite them from the master at "
                        "its next step; deepspeed.utils.safe_set_full_fp32_param writes the "
                        "master directly)", written)


def zeros_for_placeholders(optimizer) -> None:
    """DeepSpeed's epilogue gives a frozen parameter the gradient zeros_like(ds_tensor): a meta
    tensor while the 16-bit partitions are dropped. Real zeros instead (the norm reads them)."""
    device = optimizer.fp32_partitioned_groups_flat[0].device
    for grads in optimizer.averaged_gradients.values():
        for j, grad in enumerate(grads or ()):
            if grad is not None and grad.device.type == "meta":
                grads[j] = torch.zeros(grad.shape, dtype=grad.dtype, device=device)


def release_storage(buffer) -> None:
    """Frees `buffer`'s storage, keeping the tensor and its views (read only inside the step)."""
    buffer.untyped_storage().resize_(0)


def restore_storage(buffer) -> None:
    """`buffer`'s storage back at its size, contents undefined (the caller rewrites them)."""
    buffer.untyped_storage().resize_(
        (buffer.storage_offset() + buffer.numel()) * buffer.element_size())


def _point_grad_partitions_at(optimizer, buffer: torch.Tensor) -> None:
    """grad_partitions_flat_buffer := buffer, and every parameter's slot a view of it, laid
    out as DeepSpeed lays them (stage3.__init__: the parameters of fp16_groups in order)."""
    optimizer.grad_partitions_flat_buffer = buffer
    slots, offset = getattr(optimizer, GRAD_PARTITION_MAP), 0
    for group in optimizer.fp16_groups:
        for p in group:
            slots[p.ds_id] = buffer.narrow(0, offset, p.partition_numel())
            offset += p.partition_numel()


def release_grad_partitions(optimizer) -> int:
    """Free DeepSpeed's gradient partitions (grad_partitions_flat_buffer, 4 bytes per
    parameter under torch_autocast, preallocated at initialize and held for the whole run, or
    the per-parameter gradients that stand in its slots): between an optimizer step and the
    next backward no one reads them. The buffer and every slot become meta tensors of the same
    shapes, so a read in between (deepspeed.utils.safe_get_full_grad after the step) fails
    with torch's error about the meta device rather than reading freed memory.
    restore_grad_partitions gives the flat buffer back, zeroed. Returns the flat buffer's
    bytes freed (0 when already freed)."""
    buffer = optimizer.grad_partitions_flat_buffer
    freed = 0 if buffer.device.type == "meta" else buffer.untyped_storage().nbytes()
    _point_grad_partitions_at(optimizer, torch.empty_like(buffer, device="meta"))
    return freed


def restore_grad_partitions(optimizer) -> None:
    """The flat gradient buffer back, if release_grad_partitions freed it: zeroed (DeepSpeed's
    state at initialize: a slot the backward does not write, a parameter without a gradient,
    stays zero) but for the slots a per-parameter gradient holds, which are copied in."""
    buffer = optimizer.grad_partitions_flat_buffer
    if buffer.device.type == "meta":
        held = dict(getattr(optimizer, GRAD_PARTITION_MAP))
        _point_grad_partitions_at(optimizer,
                                  torch.zeros_like(buffer, device=gradient_device(optimizer)))
        slots = getattr(optimizer, GRAD_PARTITION_MAP)
        for ds_id, grad in held.items():
            if grad.device.type != "meta":
                slots[ds_id].copy_(grad)


def fill_unwritten_grad_partitions(optimizer) -> None:
    """Per-parameter gradients (reads_gradients_per_parameter): a slot no backward wrote since
    the last step (a parameter this model did not use) becomes zeros, what DeepSpeed's flat
    buffer holds there; the norm and the step read every slot."""
    buffer = optimizer.grad_partitions_flat_buffer
    device = gradient_device(optimizer)
    slots = getattr(optimizer, GRAD_PARTITION_MAP)
    for group in optimizer.fp16_groups:
        for p in group:
            if slots[p.ds_id].device.type == "meta":
                slots[p.ds_id] = torch.zeros(p.partition_numel(), dtype=buffer.dtype,
                                             device=device)


def grad_partition(optimizer, param) -> torch.Tensor:
    """This rank's slot of `param`'s gradient (in the optimizer's flat gradient buffer, or a
    tensor of its own: set_grad_partition): what DeepSpeed's optimizer step, clipping, overflow
    check and checkpoints read. Looked up on every use (offload_states/reload_states and
    restore_grad_partitions rebuild the map)."""
    return getattr(optimizer, GRAD_PARTITION_MAP)[param.ds_id]


def set_grad_partition(optimizer, param, grad: torch.Tensor) -> None:
    """`grad` (this rank's partition of `param`'s gradient, partition_numel elements) becomes
    the slot DeepSpeed reads, in place of a view of the flat buffer."""
    getattr(optimizer, GRAD_PARTITION_MAP)[param.ds_id] = grad


def micro_step_id(optimizer) -> int:
    """0 on the first micro-batch after a step (the gradient is copied in), > 0 on the next
    ones (it is added): DeepSpeed's own rule in partition_grads."""
    return optimizer.micro_step_id


def wrap_deepcompile_backend(engine, wrap, adapter: DeepSpeedAdapter) -> None:
    """engine.compile() asks get_deepspeed_compile_backend for DeepCompile's backend function;
    wrap(backend_fn) -> backend_fn' is applied to what it returns (a patch of the engine)."""

    def returning_wrapped(original):
        def get_deepspeed_compile_backend(*args, **kwargs):
            backend_fn, schedule = original(*args, **kwargs)
            return (None if backend_fn is None else wrap(backend_fn)), schedule

        return get_deepspeed_compile_backend

    adapter.wrap(engine, "get_deepspeed_compile_backend", returning_wrapped)


def deepcompile_backend_module():
    """deepspeed.compile.backend: its eager path partitions with the module-global
    min_cut_rematerialization_partition (through get_wrapped_partitioner, which first tags
    parameter aliases MUST_RECOMPUTE)."""
    import deepspeed.compile.backend as dc_backend

    return dc_backend
