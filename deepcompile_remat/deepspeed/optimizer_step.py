"""DeepSpeed's ZeRO-3 optimizer step, holding only what it reads (the takeover's patches of the
optimizer, made through its DeepSpeedAdapter).

DeepSpeed's optimizer step holds more than it reads:
  - it hands each sub-group's gradients to the torch optimizer as
    flatten(averaged_gradients).to(fp32) (_prepare_fp32_grad_for_sub_group): a copy of the
    whole gradient partition. Where DeepSpeed's step allows it
    (_ds_internals.reads_gradients_per_parameter: "per parameter") the gradients are each
    parameter's own tensor, never gathered into a flat one: each parameter's slice of the flat
    fp32 partition is stepped with its gradient (cast to fp32 one at a time under "bf16", the
    16-bit one freed as it goes), and the clipping scales each. Otherwise they are slots of
    grad_partitions_flat_buffer, and the sub-group's span of that buffer is used as it is (cast
    only where the dtypes differ); anything else (slots not side by side, a frozen parameter's
    zeros) goes through DeepSpeed's own code. The torch optimizer reads the gradient and the
    clipping scales it in place, which the gradient can take: the next first micro-batch
    replaces it;
  - under "bf16" the 16-bit parameter partitions (lp_param_buffer) and the 16-bit gradient
    buffer stay allocated through the fp32 update, which reads neither: the parameter
    partitions are rewritten from the fp32 master after it (fp16 <- fp32), the gradients were
    cast to fp32 before it. Here both are freed once every sub-group's gradient is in fp32, and
    the parameter partitions come back (rewritten from the fp32 master, as DeepSpeed would)
    after the last sub-group's update; with the takeover gathering from the fp32 master
    (_ds_internals.SixteenBitPartitions) they are not rewritten at all: nothing reads them;
  - the torch optimizer steps each sub-group's flat fp32 tensor whole, so an elementwise
    optimizer's temporaries (AdamW on CPU: 8 bytes per parameter) are the size of the rank's
    whole shard. Here it steps views of it, each at most the largest parameter's partition
    (chunked_step.py; the same values).
So the step's peak is the fp32 master, the optimizer states, the fp32 gradients and the
optimizer's own temporaries: what our own runtime's step holds. The first step (the torch
optimizer creates its state for the flat tensor) steps it whole, as DeepSpeed does.

And between steps DeepSpeed's gradient partitions do not exist (hold_gradients_only_in_the_step):
per parameter, each slot is the gradient the backward produced, freed after the step; otherwise
the flat buffer exists from the first gradient a backward writes to the end of the step.
"""
from __future__ import annotations

from typing import Optional

import torch

from deepcompile_remat.deepspeed import _ds_internals as ds
from deepcompile_remat.deepspeed.adapter import DeepSpeedAdapter
from deepcompile_remat.deepspeed.chunked_step import step_in_chunks, step_in_segments


def one_span(tensors) -> Optional[torch.Tensor]:
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


class StepWithoutCopies:
    """The four methods of DeepSpeed's step that decide what it holds, replaced (module
    docstring): _prepare_fp32_grad_for_sub_group (prepare), unscale_and_clip_grads,
    _reassign_or_swap_out_partitioned_parameters (reassign) and _optimizer_step. `per_parameter`:
    the gradient slots are per-parameter tensors; `sixteen_bit`: the takeover gathers from the
    fp32 master and keeps DeepSpeed's 16-bit partitions dropped."""

    def __init__(self, optimizer, per_parameter: bool,
                 sixteen_bit: "Optional[ds.SixteenBitPartitions]" = None):
        self.optimizer, self.per_parameter, self.sixteen_bit = optimizer, per_parameter, sixteen_bit
        self.last = len(optimizer.fp16_groups) - 1
        self.lp = getattr(optimizer, "lp_param_buffer", None)  # "bf16"/"fp16" only
        # Whether the step frees the 16-bit partitions and rewrites them after the last update.
        # Under torch_autocast they are the fp32 master (aliases): nothing to free. Under
        # optimizer offload DeepSpeed's step never reads the accelerator's gradients (no
        # prepare) and rewrites them sub-group by sub-group from the host: its own.
        self.lp_derived = (self.lp is not None and not ds.offloads_gradients(optimizer)
                           and self.lp.dtype != optimizer.fp32_partitioned_groups_flat[0].dtype)
        self.segments_of: dict = {}  # sub-group -> [(start, fp32 gradient)], per parameter
        # The granularity of our own runtime's step, one parameter's shard at a time: never
        # more chunks than parameters.
        self.chunk = max([1] + [p.ds_tensor.numel() for g in optimizer.fp16_groups for p in g])
        self.deepspeeds: dict = {}  # method name -> DeepSpeed's own

    def install(self, adapter: DeepSpeedAdapter) -> None:
        """Puts the four methods in place of DeepSpeed's on the optimizer (recorded)."""
        for name, ours in (("_prepare_fp32_grad_for_sub_group", self.prepare),
                           ("unscale_and_clip_grads", self.unscale_and_clip_grads),
                           ("_reassign_or_swap_out_partitioned_parameters", self.reassign),
                           ("_optimizer_step", self.optimizer_step)):
            self.deepspeeds[name] = adapter.replace(self.optimizer, name, ours)

    # --- before the update: the fp32 gradient of each sub-group ---------------------------

    def prepare(self, sub_group_id: int) -> None:
        """The sub-group's fp32 gradient, per parameter or as the flat buffer's span; the
        16-bit parameter partitions freed at the first sub-group, the 16-bit gradients after
        the last."""
        if sub_group_id == 0:
            self._free_parameter_partitions()
        hp = self.optimizer.fp32_partitioned_groups_flat[sub_group_id]
        if not (self.per_parameter and self._take_per_parameter(sub_group_id, hp)):
            self._take_flat(sub_group_id, hp)
        if (sub_group_id == self.last
                and self.optimizer.grad_partitions_flat_buffer.dtype != hp.dtype):
            ds.release_grad_partitions(self.optimizer)  # every gradient is in fp32 now

    def _free_parameter_partitions(self) -> None:
        if self.sixteen_bit is not None:
            self.sixteen_bit.drop()
        elif self.lp_derived:
            ds.release_storage(self.lp)

    def _take_per_parameter(self, sub_group_id: int, hp: torch.Tensor) -> bool:
        """Each parameter's gradient, cast to fp32 on its own (the 16-bit one freed as it goes),
        kept as a segment of the sub-group; False where the gradients do not tile `hp`."""
        optimizer = self.optimizer
        grads = optimizer.averaged_gradients[sub_group_id]
        if (sum(g.numel() for g in grads) != hp.numel()
                or any(g.device != hp.device for g in grads)):
            return False
        segments, start = [], 0
        for j, p in enumerate(optimizer.fp16_groups[sub_group_id]):
            grad, grads[j] = grads[j], None
            ds.set_grad_partition(optimizer, p, torch.empty_like(grad, device="meta"))
            segments.append((start, grad.to(hp.dtype)))  # a cast (and a free) under "bf16"
            start += grad.numel()
            del grad
        self.segments_of[sub_group_id] = segments
        optimizer.averaged_gradients[sub_group_id] = None
        hp.grad = None
        return True

    def _take_flat(self, sub_group_id: int, hp: torch.Tensor) -> None:
        """The flat buffer's span of the sub-group as its fp32 gradient (a cast only where
        the dtypes differ); DeepSpeed's own flatten where the slots are not one span."""
        span = one_span(self.optimizer.averaged_gradients[sub_group_id])
        if span is None or span.numel() != hp.numel() or span.device != hp.device:
            self.deepspeeds["_prepare_fp32_grad_for_sub_group"](sub_group_id)
            return
        hp.grad = span.to(hp.dtype)
        self.optimizer.averaged_gradients[sub_group_id] = None

    # --- the update ------------------------------------------------------------------------

    def unscale_and_clip_grads(self, sub_group_id: int, total_norm) -> None:
        """DeepSpeed's scaling (loss scale, clipping), applied to each parameter's gradient
        where the sub-group's gradients are per parameter; DeepSpeed's own otherwise."""
        segments = self.segments_of.get(sub_group_id)
        if segments is None:
            return self.deepspeeds["unscale_and_clip_grads"](sub_group_id, total_norm)
        factor = 1. / self._combined_scale(total_norm)
        for _, grad in segments:
            grad.mul_(factor)
        return None

    def _combined_scale(self, total_norm):
        """stage3.unscale_and_clip_grads's divisor: the loss scale, times the clipping's factor
        when the norm exceeds gradient_clipping."""
        optimizer = self.optimizer
        combined_scale = optimizer.loss_scale
        if optimizer.clip_grad > 0.:
            clip = ((total_norm / optimizer.loss_scale) + 1e-6) / optimizer.clip_grad
            combined_scale = torch.clamp(clip, min=1.0) * optimizer.loss_scale
        return combined_scale

    def optimizer_step(self, sub_group_id: int) -> None:
        """The torch optimizer's step on the sub-group's flat fp32 partition: per parameter
        segment, or in chunks of the largest parameter's shard; whole (DeepSpeed's own) where
        the optimizer has no state yet or is not known to be elementwise."""
        segments = self.segments_of.pop(sub_group_id, None)
        if segments is not None:
            self._step_segments(sub_group_id, segments)
        elif (not ds.steps_the_torch_optimizer_itself(self.optimizer)
                or not step_in_chunks(*self._step_target(sub_group_id), self.chunk)):
            self.deepspeeds["_optimizer_step"](sub_group_id)

    def _step_target(self, sub_group_id: int) -> tuple:
        """(the torch optimizer, its param group index, the sub-group's flat fp32 tensor)."""
        optimizer = self.optimizer
        return (optimizer.optimizer, optimizer.sub_group_to_group_id[sub_group_id],
                optimizer.fp32_partitioned_groups_flat[sub_group_id])

    def _step_segments(self, sub_group_id: int, segments: list) -> None:
        inner, group_id, hp = self._step_target(sub_group_id)
        if not step_in_segments(inner, group_id, hp, segments):
            hp.grad = torch.cat([grad for _, grad in segments])  # no state yet: whole
            del segments
            self.deepspeeds["_optimizer_step"](sub_group_id)

    # --- after the update: the 16-bit parameter partitions ---------------------------------

    def reassign(self, sub_group_id: int) -> None:
        """DeepSpeed's fp16 <- fp32 copy after a sub-group's update: skipped while the takeover
        gathers from the master, done for every sub-group after the last one's update where
        the 16-bit partitions were freed for the step, DeepSpeed's own otherwise."""
        if self.sixteen_bit is not None:
            return None
        if not self.lp_derived:
            return self.deepspeeds["_reassign_or_swap_out_partitioned_parameters"](sub_group_id)
        if sub_group_id == self.last:  # until then freed: rewritten after the last update
            self.bring_back_parameter_partitions()
        return None

    def bring_back_parameter_partitions(self) -> None:
        """The 16-bit parameter partitions back, rewritten from the fp32 master, if the step
        freed them (no-op otherwise, and while the takeover gathers from the master): what a
        step that raised half-way must leave for the next forward."""
        if self.sixteen_bit is not None or not self.lp_derived:
            return
        if self.lp.untyped_storage().nbytes() == 0:
            ds.restore_storage(self.lp)
            reassign = self.deepspeeds["_reassign_or_swap_out_partitioned_parameters"]
            for i in range(self.last + 1):
                reassign(i)  # fp16 <- fp32 and the parameters re-pointed, as DeepSpeed


def hold_gradients_only_in_the_step(optimizer, sixteen_bit, adapter: DeepSpeedAdapter) -> bool:
    """DeepSpeed holds its flat gradient buffer for the whole run, copies it once more in the
    optimizer step (flatten), and the backward's gradients are copied into it, so at the end
    of a backward both exist. Here, per parameter (_ds_internals.reads_gradients_per_parameter),
    there is no flat buffer: each slot is the gradient the backward produced, read by the step
    in place and freed after it. Otherwise the buffer exists from the first gradient a backward
    writes until the optimizer step that reads it. Either way the step holds no copy it does
    not read (StepWithoutCopies). Anything else that reads the buffer (offload_states) gets it
    back first, holding the gradients written so far. Every patch through `adapter`. Returns
    whether gradients are per parameter."""
    per_parameter = ds.reads_gradients_per_parameter(optimizer)
    step = StepWithoutCopies(optimizer, per_parameter, sixteen_bit)
    step.install(adapter)
    adapter.wrap(optimizer, "independent_gradient_partition_epilogue",
                 lambda epilogue: _epilogue_reading_every_slot(optimizer, epilogue,
                                                               per_parameter, sixteen_bit))
    adapter.wrap(optimizer, "step",
                 lambda deepspeeds: _step_then_release(optimizer, deepspeeds, per_parameter,
                                                       step.bring_back_parameter_partitions))
    adapter.wrap(optimizer, "offload_states",
                 lambda offload_states: _restore_then(optimizer, offload_states))
    ds.release_grad_partitions(optimizer)
    return per_parameter


def _every_slot_readable(optimizer, per_parameter: bool) -> None:
    """Before DeepSpeed reads every gradient slot (the epilogue, the step): per parameter, a
    slot no backward wrote is zeros; otherwise the flat buffer is back (zeros with no
    backward). Under optimizer offload, per parameter, neither reads a slot (the gradients
    are on the host): nothing."""
    if per_parameter and ds.offloads_gradients(optimizer):
        return
    if per_parameter:
        ds.fill_unwritten_grad_partitions(optimizer)
    else:
        ds.restore_grad_partitions(optimizer)


def _epilogue_reading_every_slot(optimizer, epilogue, per_parameter: bool, sixteen_bit):
    def epilogue_reading_every_slot(*args, **kwargs):
        _every_slot_readable(optimizer, per_parameter)
        result = epilogue(*args, **kwargs)
        if sixteen_bit is not None:
            ds.zeros_for_placeholders(optimizer)  # frozen parameters' zeros_like(ds_tensor)
        return result

    return epilogue_reading_every_slot


def _step_then_release(optimizer, step, per_parameter: bool, step_ended):
    def step_then_release(*args, **kwargs):
        _every_slot_readable(optimizer, per_parameter)
        try:
            return step(*args, **kwargs)
        finally:
            step_ended()
            ds.release_grad_partitions(optimizer)

    return step_then_release


def _restore_then(optimizer, offload_states):
    def restore_then_offload(*args, **kwargs):
        ds.restore_grad_partitions(optimizer)
        return offload_states(*args, **kwargs)

    return restore_then_offload
