"""Every DeepSpeed internal the takeover touches, in one place. Read from deepspeed 0.19.8.

Public DeepSpeed API used elsewhere (not listed here): deepspeed.initialize, the engine's
config getters (zero_optimization_stage(), zero_offload_optimizer(), ...), and the ZeRO-3
parameter attributes every ZeRO-3 user sees: ds_tensor (this rank's padded 1-D partition),
ds_numel, ds_shape, ds_id, ds_process_group.

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

from deepcompile_remat.deepspeed.chunked_step import ELEMENTWISE, step_in_chunks, step_in_segments

DEEPSPEED_VERSION_READ = "0.19.8"
log = logging.getLogger(__name__)


def warn_if_other_version() -> None:
    """Another DeepSpeed may have moved these internals: say so once (not an error: most of
    them have been stable across releases, and the tests show whether they still hold)."""
    import deepspeed

    if deepspeed.__version__ != DEEPSPEED_VERSION_READ:
        log.warning("deepcompile_remat: DeepSpeed %s; the takeover was written against %s "
                    "(deepcompile_remat/deepspeed/_ds_internals.py lists what it relies on)",
                    deepspeed.__version__, DEEPSPEED_VERSION_READ)


def stage3_optimizer_class():
    """DeepSpeed's ZeRO-3 optimizer class (imported on call, so importing this module needs no
    DeepSpeed)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return DeepSpeedZeroOptimizer_Stage3


def remove_zero3_hooks(engine) -> None:
    """DeepSpeed's gather/release module hooks, its gradient hooks and the engine's forward
    hooks, all removed; torch's F.linear restored."""
    optimizer = engine.optimizer
    optimizer.parameter_offload._remove_module_hooks()
    for hook in optimizer._grad_acc_hooks:
        hook.remove()
    optimizer._grad_acc_hooks.clear()
    for hook in getattr(optimizer, "_leaf_module_hooks", []):
        hook.remove()
    if hasattr(optimizer, "_leaf_module_hooks"):
        optimizer._leaf_module_hooks.clear()
    for attr in ("module_forward_pre_hook", "module_forward_post_hook"):
        handle = getattr(engine, attr, None)
        if handle is not None:
            handle.remove()
            setattr(engine, attr, None)
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    if hasattr(InsertPostInitMethodToModuleSubClasses, "linear_bk"):
        torch.nn.functional.linear = InsertPostInitMethodToModuleSubClasses.linear_bk


def release_gathered_parameters(engine) -> None:
    """Partition any parameter DeepSpeed holds gathered (persistent ones, small by
    stage3_param_persistence_threshold) and stop it re-gathering them after each step: from
    now on every use reads the shard."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for p in engine.module.parameters():
        p.ds_persist = False
        if p.ds_status == ZeroParamStatus.AVAILABLE:
            p.partition()
    engine.optimizer.persistent_parameters.clear()  # _post_step all-gathers these


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
    .data.copy_). Returns the bytes released."""
    released = 0
    for lp, hp in zip(optimizer.fp16_partitioned_groups_flat,
                      optimizer.fp32_partitioned_groups_flat):
        if (hp is lp or hp.dtype != lp.dtype or hp.device != lp.device or hp.shape != lp.shape
                or hp.untyped_storage().data_ptr() == lp.untyped_storage().data_ptr()
                or not torch.equal(hp, lp)):
            continue
        released += hp.untyped_storage().nbytes()
        hp.data = lp.data
    return released


def _one_span(tensors) -> "torch.Tensor | None":
    """The 1-D view covering `tensors` when they are consecutive, contiguous 1-D slices of one
    storage (DeepSpeed's per-parameter gradient slots of a sub-group), else None."""
    if not tensors or any(t is None for t in tensors):
        return None
    first = tensors[0]
    offset, ptr = first.storage_offset(), first.untyped_storage().data_ptr()
    for t in tensors:
        if (t.dim() != 1 or not t.is_contiguous() or t.dtype != first.dtype
                or t.untyped_storage().data_ptr() != ptr or t.storage_offset() != offset):
            return None
        offset += t.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,), first.storage_offset())


def reads_gradients_per_parameter(optimizer) -> bool:
    """Whether DeepSpeed's optimizer step can read each parameter's gradient partition as a
    tensor of its own (the one the backward produced) instead of a slot of the flat gradient
    buffer: everything it reads in the step either takes a list of tensors (the norm for
    clipping: averaged_gradients) or is replaced by step_without_copies (the fp32 gradient,
    the clipping's scaling, the torch optimizer's step). Not where something reads the flat
    buffer itself or the sub-group's flat fp32 gradient: fp16 (its overflow check), optimizer
    offload, DeepSpeed's torch_autocast grad scaler, ZenFlow, Muon, a torch optimizer not known
    to be elementwise."""
    return (optimizer.dtype != torch.float16 and _steps_the_torch_optimizer_itself(optimizer)
            and type(optimizer.optimizer) in ELEMENTWISE)


def _steps_the_torch_optimizer_itself(optimizer) -> bool:
    """Whether DeepSpeed's _optimizer_step is a plain torch optimizer.step() on the sub-group's
    flat fp32 tensor, which step_without_copies may replace by a step over views of it: not
    under optimizer offload, DeepSpeed's torch_autocast grad scaler, ZenFlow or Muon."""
    return not (optimizer.offload_optimizer
                or getattr(optimizer, "torch_autocast_gradscaler", None)
                or getattr(optimizer, "zenflow", False)
                or getattr(optimizer, "use_muon", False))


def step_without_copies(optimizer, per_parameter: bool,
                        sixteen_bit: "SixteenBitPartitions | None" = None):
    """DeepSpeed's optimizer step holds more than it reads:
      - it hands each sub-group's gradients to the torch optimizer as
        flatten(averaged_gradients).to(fp32) (_prepare_fp32_grad_for_sub_group): a copy of
        the whole gradient partition. With `per_parameter` (reads_gradients_per_parameter)
        the gradients are each parameter's own tensor, never gathered into a flat one: each
        parameter's slice of the flat fp32 partition is stepped with its gradient (cast to
        fp32 one at a time under "bf16", the 16-bit one freed as it goes), and the clipping
        scales each. Otherwise they are slots of grad_partitions_flat_buffer, and the
        sub-group's span of that buffer is used as it is (cast only where the dtypes differ);
        anything else (slots not side by side, a frozen parameter's zeros) goes through
        DeepSpeed's own code. The torch optimizer reads the gradient and the clipping scales
        it in place, which the gradient can take: the next first micro-batch replaces it;
      - under "bf16" the 16-bit parameter partitions (lp_param_buffer) and the 16-bit gradient
        buffer stay allocated through the fp32 update, which reads neither: the parameter
        partitions are rewritten from the fp32 master after it (fp16 <- fp32), the gradients
        were cast to fp32 before it. Here both are freed once every sub-group's gradient is in
        fp32, and the parameter partitions come back (rewritten from the fp32 master, as
        DeepSpeed would) after the last sub-group's update.
      - the torch optimizer steps each sub-group's flat fp32 tensor whole, so an elementwise
        optimizer's temporaries (AdamW on CPU: 8 bytes per parameter) are the size of the
        rank's whole shard. Here it steps views of it, each at most the largest parameter's
        partition (chunked_step.py; the same values).
      - with `sixteen_bit` (the takeover gathers from the fp32 master) the 16-bit parameter
        partitions are not rewritten after the update at all: nothing reads them.
    So the step's peak is the fp32 master, the optimizer states, the fp32 gradients and the
    optimizer's own temporaries: what our own runtime's step holds. The first step (the torch
    optimizer creates its state for the flat tensor) steps it whole, as DeepSpeed does. Returns
    a function to call when the step has ended, however it ended: it brings the parameter
    partitions back (rewritten from the fp32 master) if a step that raised left them freed,
    since the next forward reads them."""
    prepare_original = optimizer._prepare_fp32_grad_for_sub_group
    reassign_original = optimizer._reassign_or_swap_out_partitioned_parameters
    unscale_original = optimizer.unscale_and_clip_grads
    step_original = optimizer._optimizer_step
    last = len(optimizer.fp16_groups) - 1
    lp = getattr(optimizer, "lp_param_buffer", None)
    # Under torch_autocast the parameter partitions are the fp32 master (aliases): nothing to free.
    lp_derived = lp is not None and lp.dtype != optimizer.fp32_partitioned_groups_flat[0].dtype
    segments_of: dict = {}  # sub-group -> [(start, fp32 gradient)], per_parameter only

    def take_per_parameter(sub_group_id, hp) -> bool:
        grads = optimizer.averaged_gradients[sub_group_id]
        if (sum(g.numel() for g in grads) != hp.numel()
                or any(g.device != hp.device for g in grads)):
            return False
        segments, start = [], 0
        for j, p in enumerate(optimizer.fp16_groups[sub_group_id]):
            grad, grads[j] = grads[j], None
            set_grad_partition(optimizer, p, torch.empty_like(grad, device="meta"))
            segments.append((start, grad.to(hp.dtype)))  # a cast (and a free) under "bf16"
            start += grad.numel()
            del grad
        segments_of[sub_group_id] = segments
        optimizer.averaged_gradients[sub_group_id] = None
        hp.grad = None
        return True

    def prepare(sub_group_id):
        if sub_group_id == 0 and sixteen_bit is not None:
            sixteen_bit.drop()
        elif sub_group_id == 0 and lp_derived:
            _release(lp)
        hp = optimizer.fp32_partitioned_groups_flat[sub_group_id]
        if not (per_parameter and take_per_parameter(sub_group_id, hp)):
            span = _one_span(optimizer.averaged_gradients[sub_group_id])
            if span is None or span.numel() != hp.numel() or span.device != hp.device:
                prepare_original(sub_group_id)
            else:
                hp.grad = span.to(hp.dtype)
                optimizer.averaged_gradients[sub_group_id] = None
        if sub_group_id == last and optimizer.grad_partitions_flat_buffer.dtype != hp.dtype:
            release_grad_partitions(optimizer)  # every sub-group's gradient is in fp32 now

    def unscale_and_clip_grads(sub_group_id, total_norm):
        segments = segments_of.get(sub_group_id)
        if segments is None:
            return unscale_original(sub_group_id, total_norm)
        # stage3.unscale_and_clip_grads's factor (loss scale, and the clipping when the norm
        # exceeds it), applied to each parameter's gradient instead of the flat one.
        combined_scale = optimizer.loss_scale
        if optimizer.clip_grad > 0.:
            clip = ((total_norm / optimizer.loss_scale) + 1e-6) / optimizer.clip_grad
            combined_scale = torch.clamp(clip, min=1.0) * optimizer.loss_scale
        for _, grad in segments:
            grad.mul_(1. / combined_scale)
        return None

    def bring_back_parameter_partitions() -> None:
        if sixteen_bit is not None:
            return  # dropped for good: the forward gathers from the master
        if lp_derived and lp.untyped_storage().nbytes() == 0:
            _restore(lp)
            for i in range(last + 1):
                reassign_original(i)  # fp16 <- fp32 and the parameters re-pointed, as DeepSpeed

    def reassign(sub_group_id):
        if sixteen_bit is not None:
            return None
        if not lp_derived:
            return reassign_original(sub_group_id)
        if sub_group_id == last:  # until then freed: rewritten after the last update
            bring_back_parameter_partitions()
        return None

    # The granularity of our own runtime's step, one parameter's shard at a time: never more
    # chunks than parameters.
    chunk = max([1] + [p.ds_tensor.numel() for g in optimizer.fp16_groups for p in g])

    def optimizer_step(sub_group_id):
        inner = optimizer.optimizer
        group_id = optimizer.sub_group_to_group_id[sub_group_id]
        hp = optimizer.fp32_partitioned_groups_flat[sub_group_id]
        segments = segments_of.pop(sub_group_id, None)
        if segments is not None:
            if not step_in_segments(inner, group_id, hp, segments):
                hp.grad = torch.cat([grad for _, grad in segments])  # no state yet: whole
                del segments
                step_original(sub_group_id)
        elif (not _steps_the_torch_optimizer_itself(optimizer)
                or not step_in_chunks(inner, group_id, hp, chunk)):
            step_original(sub_group_id)

    optimizer._prepare_fp32_grad_for_sub_group = prepare
    optimizer.unscale_and_clip_grads = unscale_and_clip_grads
    optimizer._reassign_or_swap_out_partitioned_parameters = reassign
    optimizer._optimizer_step = optimizer_step
    return bring_back_parameter_partitions


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


# What of DeepSpeed reads or writes the 16-bit parameter partitions outside the forward,
# backward and step the takeover runs: checkpoint loads, refresh_fp32_params,
# offload/reload_states (optimizer methods), and gathers of a parameter
# (GatheredParameters, 16-bit model saves: methods every ZeRO-3 parameter carries).
_OPTIMIZER_METHODS_READING_16BIT = (
    "load_state_dict", "refresh_fp32_params", "_restore_from_bit16_weights",
    "offload_states", "reload_states", "load_hp_checkpoint_state_from_checkpoint_dir_stage3",
    "load_module_checkpoint_state_from_checkpoint_dir_stage3")
_PARAMETER_METHODS_READING_16BIT = ("all_gather", "all_gather_coalesced")


class SixteenBitPartitions:
    """DeepSpeed's 16-bit parameter partitions (lp_param_buffer; each parameter's ds_tensor a
    view of it: 2 bytes per parameter under "bf16") while the takeover gathers from the fp32
    master: nothing of the takeover's forward, backward or step reads them, so they are
    dropped, and brought back (rewritten from the master, as DeepSpeed's step would have left
    them) for the DeepSpeed code that does read them (the methods above), until the next
    forward drops them again. While dropped each parameter's ds_tensor is a meta tensor of the
    same shape and attributes, so a read of its values is torch's meta-device error, never
    freed memory. A write to them while they are back (GatheredParameters with modifier_rank:
    stock DeepSpeed would overwrite it from the master at its next step) is copied into the
    master when they are dropped, with a warning: training continues from what was written."""

    def __init__(self, optimizer, params):
        self.optimizer, self.params = optimizer, list(params)
        self.buffer = optimizer.lp_param_buffer
        self.nbytes = self.buffer.numel() * self.buffer.element_size()
        self._originals: dict = {}  # ds_id -> DeepSpeed's ds_tensor, while dropped
        for name in _OPTIMIZER_METHODS_READING_16BIT:
            self._bring_back_before(optimizer, name)
        for p in self.params:
            for name in _PARAMETER_METHODS_READING_16BIT:
                self._bring_back_before(p, name)

    @property
    def dropped(self) -> bool:
        """Whether the 16-bit partitions are dropped now (meta placeholders in ds_tensor)."""
        return bool(self._originals)

    def _bring_back_before(self, owner, name: str) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return

        def brought_back_first(*args, **kwargs):
            self.bring_back()
            return original(*args, **kwargs)

        setattr(owner, name, brought_back_first)

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
        _release(self.buffer)

    def bring_back(self) -> None:
        """The 16-bit partitions back, rewritten from the fp32 master, and each ds_tensor
        DeepSpeed's own again. No-op when they are there."""
        if not self.dropped:
            return
        _restore(self.buffer)
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


def _release(buffer) -> None:
    """Frees `buffer`'s storage, keeping the tensor and its views (read only inside the step)."""
    buffer.untyped_storage().resize_(0)


def _restore(buffer) -> None:
    """`buffer`'s storage back at its size, contents undefined (the caller rewrites them)."""
    buffer.untyped_storage().resize_(
        (buffer.storage_offset() + buffer.numel()) * buffer.element_size())


_GRAD_MAP = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


def _point_grad_partitions_at(optimizer, buffer: torch.Tensor) -> None:
    """grad_partitions_flat_buffer := buffer, and every parameter's slot a view of it, laid
    out as DeepSpeed lays them (stage3.__init__: the parameters of fp16_groups in order)."""
    optimizer.grad_partitions_flat_buffer = buffer
    slots, offset = getattr(optimizer, _GRAD_MAP), 0
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
        held = dict(getattr(optimizer, _GRAD_MAP))
        device = optimizer.fp32_partitioned_groups_flat[0].device
        _point_grad_partitions_at(optimizer, torch.zeros_like(buffer, device=device))
        slots = getattr(optimizer, _GRAD_MAP)
        for ds_id, grad in held.items():
            if grad.device.type != "meta":
                slots[ds_id].copy_(grad)


def fill_unwritten_grad_partitions(optimizer) -> None:
    """Per-parameter gradients (reads_gradients_per_parameter): a slot no backward wrote since
    the last step (a parameter this model did not use) becomes zeros, what DeepSpeed's flat
    buffer holds there; the norm and the step read every slot."""
    buffer = optimizer.grad_partitions_flat_buffer
    device = optimizer.fp32_partitioned_groups_flat[0].device
    slots = getattr(optimizer, _GRAD_MAP)
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
    return getattr(optimizer, _GRAD_MAP)[param.ds_id]


def set_grad_partition(optimizer, param, grad: torch.Tensor) -> None:
    """`grad` (this rank's partition of `param`'s gradient, partition_numel elements) becomes
    the slot DeepSpeed reads, in place of a view of the flat buffer."""
    getattr(optimizer, _GRAD_MAP)[param.ds_id] = grad


def micro_step_id(optimizer) -> int:
    """0 on the first micro-batch after a step (the gradient is copied in), > 0 on the next
    ones (it is added): DeepSpeed's own rule in partition_grads."""
    return optimizer.micro_step_id


def wrap_deepcompile_backend(engine, wrap) -> None:
    """engine.compile() asks get_deepspeed_compile_backend for DeepCompile's backend function;
    wrap(backend_fn) -> backend_fn' is applied to what it returns."""
    original = engine.get_deepspeed_compile_backend

    def get_deepspeed_compile_backend(*args, **kwargs):
        backend_fn, schedule = original(*args, **kwargs)
        return (None if backend_fn is None else wrap(backend_fn)), schedule

    engine.get_deepspeed_compile_backend = get_deepspeed_compile_backend


def deepcompile_backend_module():
    """deepspeed.compile.backend: its eager path partitions with the module-global
    min_cut_rematerialization_partition (through get_wrapped_partitioner, which first tags
    parameter aliases MUST_RECOMPUTE)."""
    import deepspeed.compile.backend as dc_backend

    return dc_backend
