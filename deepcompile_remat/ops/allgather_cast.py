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
    CUDA:       deepcompile_remat._cuda casts all shards in one launch and gathers them in one
                NCCL group on a side stream ordered after the current stream.

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

    def __init__(self, outputs: List[torch.Tensor], works=(), cuda_event=None, keep_alive=()):
        self._outputs = outputs
        self._works = list(works)
        self._cuda_event = cuda_event
        self._keep_alive = keep_alive  # shards/outputs the comm stream still uses
        self._done = False

    def wait(self) -> List[torch.Tensor]:
        if not self._done:
            for work in self._works:
                work.wait()
            if self._cuda_event is not None:
                self._cuda_event.wait(torch.cuda.current_stream(self._outputs[0].device).cuda_stream)
            self._works, self._keep_alive, self._done = [], (), True
        return self._outputs

    def is_completed(self) -> bool:
        if self._done:
            return True
        works_done = all(w.is_completed() for w in self._works)
        return works_done and (self._cuda_event is None or self._cuda_event.query())


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


def _allgather_cast_cuda(shards, outputs, dtype, group, world: int, async_op: bool):
    cuda = cuda_module.require_cuda_module()
    device = shards[0].device
    casting = dtype != shards[0].dtype
    option = torch_nan_option("cuda", dtype) if casting else None
    if casting and option is None:
        raise RuntimeError(f"torch's CUDA NaN encoding for {dtype} matches no kernel option")
    compute = torch.cuda.current_stream(device)
    side = cuda_module.comm_stream(device)
    shards = [s.contiguous() for s in shards]
    if world == 1:
        comm_shards, comm_outs = shards, outputs
        # No communicator needed: the cast (or copy) is the whole gather.
        with torch.cuda.stream(side):
            side.wait_stream(compute)
            if casting:
                cuda.cast_into_slots([s.data_ptr() for s in shards],
                                     [o.data_ptr() for o in outputs],
                                     [s.numel() for s in shards], target_name(dtype),
                                     option.nan_mode, option.canonical_nan, side.cuda_stream)
            else:
                for s, o in zip(shards, outputs):
                    o.copy_(s)
        event = torch.cuda.Event()
        event.record(side)
    else:
        comm = cuda_module.communicator(group, device)
        event = comm.allgather_cast(
            [s.data_ptr() for s in shards], [o.data_ptr() for o in outputs],
            [s.numel() for s in shards], target_name(dtype) if casting else "copy",
            outputs[0].element_size(), option.nan_mode if option else "quiet",
            option.canonical_nan if option else 0, compute.cuda_stream, side.cuda_stream)
        comm_shards, comm_outs = shards, outputs
    # The caching allocator must not hand these blocks to another stream before the side
    # stream is done with them.
    for t in (*comm_shards, *comm_outs):
        t.record_stream(side)
    handle = AllGatherHandle(outputs, cuda_event=_EventAdapter(event),
                             keep_alive=(comm_shards, comm_outs))
    return handle if async_op else handle.wait()


class _EventAdapter:
    """torch.cuda.Event and _cuda.Event behind one wait(stream_handle)/query() interface."""

    def __init__(self, event):
        self._event = event

    def wait(self, stream_handle: int) -> None:
        if isinstance(self._event, torch.cuda.Event):
            self._event.wait(torch.cuda.ExternalStream(stream_handle))
        else:
            self._event.wait(stream_handle)

    def query(self) -> bool:
        return self._event.query()


def allgather_cast(shards: Sequence[torch.Tensor], outputs: Optional[Sequence[torch.Tensor]] = None,
                   dtype: Optional[torch.dtype] = None, group=None, async_op: bool = False):
    """See the module docstring. Returns the list of outputs, or an AllGatherHandle."""
    world, rank = _world_and_rank(group)
    outputs, dtype = _check_and_allocate(shards, outputs, dtype, world)
    if shards[0].is_cuda:
        return _allgather_cast_cuda(shards, outputs, dtype, group, world, async_op)
    if shards[0].device.type != "cpu":
        raise ValueError(f"allgather_cast supports cpu and cuda tensors, not {shards[0].device}")
    with torch.no_grad():
        _fill_slots_cpu(shards, outputs, dtype, rank)
    works = _gather_cpu(outputs, shards, group, world, rank, async_op) if world > 1 else []
    handle = AllGatherHandle(outputs, works=works)
    return handle if async_op else handle.wait()
