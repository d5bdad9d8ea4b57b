"""allgather_cast: gather a bucket of ZeRO-3 shards into full parameters, casting on the way.

    outputs = allgather_cast(shards, outputs=None, dtype=None, group=None, async_op=False)

shards[i] is this rank's flat shard of parameter i (1-D, padded so every rank holds the same
length n_i); outputs[i] is the flat full parameter, world * n_i elements of `dtype` (default:
the shard dtype, i.e. no cast), allocated when not given. Rank r's shard lands in
outputs[i][r * n_i : (r + 1) * n_i].

Cast before gather: each shard is cast straight into this rank's slot of its output and the
slots are then all-gathered in place, so a bf16/fp16 gather moves half the bytes of an fp32 one
and no full fp32 copy of the weight is ever made.

    CPU (gloo): the C++ kernel (deepcompile_remat._C) casts into the slots, then one
                all_gather_into_tensor per output (issued together when async_op, one
                handle for the bucket; one after another otherwise);
    CUDA:       deepcompile_remat._cuda casts all shards in one launch on the current stream,
                then the process group (NCCL) gathers the slots in place, coalesced into one
                NCCL group: one communicator for every collective of the step.

async_op=True returns an AllGatherHandle; its wait() returns the outputs (on CUDA it makes the
current stream wait, the host does not). Otherwise the outputs are returned, ready to use in
stream order.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from deepcompile_remat.ops import cuda_module
from deepcompile_remat.ops.nan_policy import target_name, torch_nan_option

_CASTABLE = (torch.bfloat16, torch.float16)


class AllGatherHandle:
    """The pending gather of a bucket. wait() returns the outputs once they may be read."""

    def __init__(self, outputs: List[torch.Tensor], works=()):
        self._outputs = outputs
        self._works = list(works)
        self._done = False

    def wait(self) -> List[torch.Tensor]:
        if not self._done:
            for work in self._works:
                work.wait()
            self._works, self._done = [], True
        return self._outputs

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)


def _world_and_rank(group) -> tuple:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _check_and_allocate(shards: Sequence[torch.Tensor], outputs, dtype, world: int):
    if len(shards) == 0:
        raise ValueError("allgather_cast needs at least one shard")
    device = shards[0].device
    for s in shards:
        if s.dim() != 1:
            raise ValueError(f"shards must be 1-D (flat, padded), got shape {tuple(s.shape)}")
        if s.device != device or s.dtype != shards[0].dtype:
            raise ValueError("all shards of a bucket must share device and dtype")
    dtype = shards[0].dtype if dtype is None else dtype
    if dtype != shards[0].dtype and (shards[0].dtype != torch.float32 or dtype not in _CASTABLE):
        raise ValueError(f"cast {shards[0].dtype} -> {dtype} is not supported "
                         "(float32 -> bfloat16/float16, or no cast)")
    if outputs is None:
        outputs = [torch.empty(world * s.numel(), dtype=dtype, device=device) for s in shards]
    outputs = list(outputs)
    if len(outputs) != len(shards):
        raise ValueError("one output per shard")
    for s, o in zip(shards, outputs):
        if o.dtype != dtype or o.device != device or o.dim() != 1 or not o.is_contiguous():
            raise ValueError(f"output must be a contiguous 1-D {dtype} tensor on {device}")
        if o.numel() != world * s.numel():
            raise ValueError(f"output has {o.numel()} elements, expected world ({world}) x "
                             f"shard ({s.numel()})")
    return outputs, dtype


def _fill_slots_cpu(shards, outputs, dtype, rank: int) -> None:
    """Each shard into this rank's slot of its output: the C++ kernel when it reproduces
    torch's bits (see nan_policy), else torch's own copy/cast into the slot view."""
    option = (torch_nan_option("cpu", dtype)
              if shards[0].dtype == torch.float32 and dtype in _CASTABLE else None)
    if option is None:
        for s, o in zip(shards, outputs):
            o.view(-1, s.numel())[rank].copy_(s)
        return
    from deepcompile_remat import _C

    srcs = [s.detach().contiguous().numpy() for s in shards]
    dsts = [o.view(torch.int16).numpy() for o in outputs]  # bf16 has no numpy dtype
    offsets = [rank * s.numel() for s in shards]
    _C.cast_shards_into_slots(srcs, dsts, offsets, target_name(dtype), option.nan_mode,
                              option.canonical_nan)


def _gather_cpu(outputs, shards, group, world: int, rank: int, async_op: bool) -> list:
    """In-place gather per output; returns the works still pending. The transfer is bytes
    only, so outputs travel as uint8 (gloo knows neither int16 nor, everywhere, bf16). A
    synchronous call waits for each gather before the next: gloo's worker threads have crashed
    under many concurrent collectives of one group, and nothing overlaps them then anyway."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    works = []
    for o in outputs:
        flat = o.view(torch.uint8)
        slot = flat.view(world, -1)[rank]
        work = gather(flat, slot, group=group, async_op=True)
        if async_op:
            works.append(work)
        else:
            work.wait()
    return works


def _allgather_cast_cuda(shards, outputs, dtype, group, world: int, rank: int, async_op: bool):
    """Cast into the slots with our kernel, gather through the process group.

    One kernel launch casts every shard into this rank's slot of its output, on the current
    stream (so it is ordered after whatever produced the shards, and the caching allocator
    sees every use on that stream). The slots are then gathered in place by the process
    group's own all_gather_into_tensor, coalesced into one NCCL group: the same communicator
    and stream as the reduce-scatters and functional-collective prefetches, so nothing runs
    on a second communicator that NCCL could interleave differently on two ranks (the private
    communicator that did this is gone from the runtime; benchmarks/bench_allgather_cast.py
    still times it against this path)."""
    cuda = cuda_module.require_cuda_module()
    device = shards[0].device
    casting = dtype != shards[0].dtype
    option = torch_nan_option("cuda", dtype) if casting else None
    if casting and option is None:
        raise RuntimeError(f"torch's CUDA NaN encoding for {dtype} matches no kernel option")
    shards = [s.contiguous() for s in shards]
    slots = [o.view(world, -1)[rank] for o in outputs]
    if casting:
        cuda.cast_into_slots([s.data_ptr() for s in shards], [sl.data_ptr() for sl in slots],
                             [s.numel() for s in shards], target_name(dtype), option.nan_mode,
                             option.canonical_nan, torch.cuda.current_stream(device).cuda_stream)
    else:
        for s, sl in zip(shards, slots):
            sl.copy_(s)
    works = []
    if world > 1:
        with dist._coalescing_manager(group, device, async_ops=True) as coalesced:
            for o, sl in zip(outputs, slots):
                dist.all_gather_into_tensor(o, sl, group=group)
        works = [coalesced]  # its wait() makes the current stream wait; the host does not
    handle = AllGatherHandle(outputs, works=works)
    return handle if async_op else handle.wait()


def allgather_cast(shards: Sequence[torch.Tensor], outputs: Optional[Sequence[torch.Tensor]] = None,
                   dtype: Optional[torch.dtype] = None, group=None, async_op: bool = False):
    """See the module docstring. Returns the list of outputs, or an AllGatherHandle."""
    world, rank = _world_and_rank(group)
    outputs, dtype = _check_and_allocate(shards, outputs, dtype, world)
    if shards[0].is_cuda:
        return _allgather_cast_cuda(shards, outputs, dtype, group, world, rank, async_op)
    if shards[0].device.type != "cpu":
        raise ValueError(f"allgather_cast supports cpu and cuda tensors, not {shards[0].device}")
    with torch.no_grad():
        _fill_slots_cpu(shards, outputs, dtype, rank)
    works = _gather_cpu(outputs, shards, group, world, rank, async_op) if world > 1 else []
    handle = AllGatherHandle(outputs, works=works)
    return handle if async_op else handle.wait()
