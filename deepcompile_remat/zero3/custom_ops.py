"""The ZeRO-3 collectives as torch.library custom ops, so torch.compile traces them as nodes.

    full = torch.ops.dcr.allgather_cast(shard, world_size, group_name, dtype)
        the flat, padded full parameter (world_size * shard.numel() elements) in `dtype`
        (None: the shard's dtype). Each rank casts its shard straight into its own slot of the
        output, then the slots are all-gathered in place: a downcast gather moves half the bytes
        and no full-precision copy of the weight ever exists.
        Backward: reduce_scatter_grad of the gradient (cast back to the shard's dtype).
    full = torch.ops.dcr.allgather_cast_start(shard, world_size, group_name, dtype)
    torch.ops.dcr.allgather_cast_wait(full)
        the same gather in two halves, for a gather the schedule moved ahead of its first use
        (zero3/schedule.py): the start issues it (cast into the slot, collective in flight) and
        returns the output, not yet valid; the wait, a mutation of `full` as far as the compiler
        knows, is placed before the first use, so nothing reads `full` before it. The start
        is deepcompile_remat.comm.cast_and_gather with async_op=True; allgather_cast is start +
        wait. (The bucket op below runs its packed form, comm.cast_and_gather_packed: the same
        fill_slots + gather_slots.)
    grad_shard = torch.ops.dcr.reduce_scatter_grad(full_grad, world_size, group_name)
        the average over ranks of each rank's full gradient, this rank's slot only (data
        parallel: the mean over the global batch when each rank's loss is a local mean).
    grad_shards = torch.ops.dcr.reduce_scatter_grad_bucket(full_grads, world_size, group_name)
        the same for several small gradients in one collective (zero3/grad_buckets.py).

Fake implementations give shapes for tracing; the process group is named by its group_name
(resolved on every call, so graphs hold no Python objects). The CUDA path uses the fused
kernels of deepcompile_remat.comm when they were built, else torch's own cast + collective.
"""
from __future__ import annotations

import atexit
from typing import Optional

import torch
import torch.distributed as dist

from deepcompile_remat import comm
from deepcompile_remat.comm.collectives import backend_name


class CommStats:
    """Bytes this process sent and received through the ops (for the measurements)."""

    allgather_bytes = 0
    reduce_scatter_bytes = 0
    allgather_calls = 0
    reduce_scatter_calls = 0

    @classmethod
    def reset(cls) -> None:
        """Zeroes every counter."""
        cls.allgather_bytes = cls.reduce_scatter_bytes = 0
        cls.allgather_calls = cls.reduce_scatter_calls = 0


def resolve_group(group_name: str):
    """The process group registered under `group_name` (graphs carry groups by name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _gather_into(shards, outputs, dtype, group, async_op: bool = False):
    """Cast each shard into this rank's slot of its output, then gather the slots in place:
    deepcompile_remat.comm.cast_and_gather, the single form of the one cast + gather path
    (fill_slots + gather_slots) that the packed form of the buckets
    (cast_and_gather_packed, dcr::allgather_cast_bucket) shares; the same on CPU, CUDA, NCCL,
    gloo and torch's fake process group of emulated worlds. Returns the handle when async_op."""
    return comm.cast_and_gather(list(shards), list(outputs), dtype=dtype, group=group,
                                  async_op=async_op)


def _count_gather(out: torch.Tensor, world_size: int) -> None:
    CommStats.allgather_bytes += out.numel() * out.element_size() * (world_size - 1) // world_size
    CommStats.allgather_calls += 1


# Gathers started and not yet waited on, by their output's storage (a start's output is handed
# to exactly one wait; the graph, not Python identity, carries it from one to the other).
_in_flight: dict = {}


def gathers_in_flight() -> int:
    """How many gathers allgather_cast_start began that no wait has finished yet (0 between
    steps; more only inside a step, or after a step that raised between a start and its wait)."""
    return len(_in_flight)


def release_in_flight(wait: bool = True) -> int:
    """Drops every gather still in flight, so that no collective or work object of ours outlives
    the step that started it; returns how many there were. A step that raised between a start
    and its wait leaves one behind, holding the communicator's context: call this before
    dist.destroy_process_group(). wait=True first waits for each (every rank must have started
    the same gathers, else this blocks until the group's timeout; a wait that fails because
    the group is gone still drops the work). At interpreter exit it runs with wait=False
    (atexit, while the interpreter is whole): a crashed step never becomes a hang at exit, and
    no work of ours is destroyed during finalization."""
    handles = list(_in_flight.values())
    _in_flight.clear()
    if wait:
        for handle in handles:
            if handle is not None:
                try:
                    handle.wait()
                except RuntimeError:  # the group was destroyed or aborted under it
                    pass
    return len(handles)


atexit.register(release_in_flight, wait=False)


def _key(full: torch.Tensor) -> int:
    return full.untyped_storage().data_ptr()


def _start(shard: torch.Tensor, world_size: int, group_name: str, dtype) -> torch.Tensor:
    dtype = shard.dtype if dtype is None else dtype
    out = shard.new_empty(world_size * shard.numel(), dtype=dtype)
    if world_size == 1 and not dist.is_initialized():  # standalone use, no process group
        out.copy_(shard.reshape(-1))
        handle = None
    else:
        handle = _gather_into([shard.reshape(-1)], [out], dtype, resolve_group(group_name),
                              async_op=True)
        _count_gather(out, world_size)
    _in_flight[_key(out)] = handle
    return out


def _wait(full: torch.Tensor) -> None:
    try:
        handle = _in_flight.pop(_key(full))
    except KeyError:
        raise RuntimeError("dcr::allgather_cast_wait: no gather in flight into this tensor (a "
                           "wait without its start, or waited twice)") from None
    if handle is not None:
        handle.wait()


def _full_like(shard, world_size, dtype):
    return shard.new_empty(world_size * shard.numel(), dtype=shard.dtype if dtype is None else dtype)


@torch.library.custom_op("dcr::allgather_cast_start", mutates_args=())
def allgather_cast_start(shard: torch.Tensor, world_size: int, group_name: str,
                         dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Starts gathering `shard` from all `world_size` ranks, cast to `dtype` (None: no cast), and
    returns the full flat output, not yet readable: allgather_cast_wait on it must come before
    any use. The split lets a graph run compute between start and wait."""
    return _start(shard, world_size, group_name, dtype)


@allgather_cast_start.register_fake
def _(shard, world_size, group_name, dtype=None):
    return _full_like(shard, world_size, dtype)


@torch.library.custom_op("dcr::allgather_cast_wait", mutates_args=("full",))
def allgather_cast_wait(full: torch.Tensor) -> None:
    """Waits for the gather allgather_cast_start began into `full`; a RuntimeError when none is
    in flight there."""
    _wait(full)


@allgather_cast_wait.register_fake
def _(full):
    return None


@torch.library.custom_op("dcr::allgather_cast", mutates_args=())
def allgather_cast(shard: torch.Tensor, world_size: int, group_name: str,
                   dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The full flat parameter: `shard` gathered from all `world_size` ranks, cast to `dtype`
    (None: no cast) before the gather so the wire carries the smaller dtype."""
    out = _start(shard, world_size, group_name, dtype)
    _wait(out)
    return out


@allgather_cast.register_fake
def _(shard, world_size, group_name, dtype=None):
    return _full_like(shard, world_size, dtype)


def _reduce_scatter_mean(full: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """This rank's slot of the mean over ranks of a flat, contiguous full gradient."""
    group = resolve_group(group_name)
    out = full.new_empty(full.numel() // world_size)
    # Gloo has no AVG reduction: sum, then divide. Gloo's single-tensor reduce-scatter clones
    # the whole full gradient first (one more fp32 full weight at the backward's peak); its
    # list form reduces the chunks where they are.
    if backend_name(group, full.device.type) == "gloo":
        dist.reduce_scatter(out, list(full.chunk(world_size)), group=group)
    else:
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(out, full, group=group)
    out.div_(world_size)
    CommStats.reduce_scatter_bytes += full.numel() * full.element_size() * (world_size - 1) // world_size
    CommStats.reduce_scatter_calls += 1
    return out


@torch.library.custom_op("dcr::reduce_scatter_grad", mutates_args=())
def reduce_scatter_grad(full_grad: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """This rank's shard of the gradient averaged over the group: `full_grad` reduce-scattered
    (a copy when world_size is 1)."""
    full_grad = full_grad.contiguous()
    if world_size == 1:
        return full_grad.clone()
    return _reduce_scatter_mean(full_grad.reshape(-1), world_size, group_name)


@reduce_scatter_grad.register_fake
def _(full_grad, world_size, group_name):
    return full_grad.new_empty(full_grad.numel() // world_size)


def _setup_context(ctx, inputs, output):
    shard, world_size, group_name, _ = inputs
    ctx.world_size, ctx.group_name, ctx.shard_dtype = world_size, group_name, shard.dtype


def _backward(ctx, grad):
    grad = grad.to(ctx.shard_dtype)
    return torch.ops.dcr.reduce_scatter_grad(grad, ctx.world_size, ctx.group_name), None, None, None


allgather_cast.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("dcr::allgather_cast_bucket", mutates_args=())
def allgather_cast_bucket(shards: list[torch.Tensor], world_size: int, group_name: str,
                          dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
    """One collective for a bucket of small parameters: every shard is cast into this rank's
    slot of one buffer, the buffer is gathered once, and each full parameter is copied out.
    Used by the schedule (zero3/schedule.py) inside already-differentiated graphs: no autograd."""
    _check_bucket(shards)
    sizes = [s.numel() for s in shards]
    group = resolve_group(group_name) if dist.is_initialized() else None
    buf = comm.cast_and_gather_packed(shards, dtype, group)  # one collective, cast on the way
    if world_size > 1:
        _count_gather(buf, world_size)
    rows = buf.view(world_size, sum(sizes))
    return [block.reshape(-1).clone() for block in rows.split(sizes, dim=1)]


def _check_one_buffer(op: str, what: str, tensors) -> None:
    """One buffer holds a bucket: every tensor must have the first one's dtype and device."""
    if not tensors:
        raise ValueError(f"{op}: empty bucket")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"{op}: {what} {i} is {t.dtype} on {t.device}, {what} 0 is {first.dtype} on "
                f"{first.device}; a bucket's {what}s must share dtype and device")


def _check_bucket(shards) -> None:
    _check_one_buffer("dcr::allgather_cast_bucket", "shard", shards)


@allgather_cast_bucket.register_fake
def _(shards, world_size, group_name, dtype=None):
    _check_bucket(shards)
    return [s.new_empty(world_size * s.numel(), dtype=s.dtype if dtype is None else dtype)
            for s in shards]


@torch.library.custom_op("dcr::reduce_scatter_grad_bucket", mutates_args=())
def reduce_scatter_grad_bucket(full_grads: list[torch.Tensor], world_size: int,
                               group_name: str) -> list[torch.Tensor]:
    """reduce_scatter_grad of each full gradient, in one collective: rank r's slots of all of
    them are laid side by side in row r of one buffer, so the buffer's r-th chunk is exactly
    what rank r keeps. Per element the same sum as one collective per gradient."""
    _check_grad_bucket(full_grads, world_size)
    sizes = [g.numel() // world_size for g in full_grads]
    if world_size == 1:
        return [g.reshape(-1).clone() for g in full_grads]
    rows = torch.cat([g.reshape(world_size, n) for g, n in zip(full_grads, sizes)], dim=1)
    mine = _reduce_scatter_mean(rows.reshape(-1), world_size, group_name)
    return [part.clone() for part in mine.split(sizes)]


def _check_grad_bucket(full_grads, world_size: int) -> None:
    _check_one_buffer("dcr::reduce_scatter_grad_bucket", "gradient", full_grads)
    for i, g in enumerate(full_grads):
        if g.numel() % world_size:
            raise ValueError(f"dcr::reduce_scatter_grad_bucket: gradient {i} has {g.numel()} "
                             f"elements, not a multiple of the world size {world_size}")


@reduce_scatter_grad_bucket.register_fake
def _(full_grads, world_size, group_name):
    _check_grad_bucket(full_grads, world_size)
    return [g.new_empty(g.numel() // world_size) for g in full_grads]
