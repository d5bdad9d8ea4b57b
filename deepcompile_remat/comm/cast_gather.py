"""cast_and_gather: gather a bucket of ZeRO-3 shards into full parameters, casting on the way.

    outputs = cast_and_gather(shards, outputs=None, dtype=None, group=None, async_op=False)
    handle = cast_and_gather(shards, ..., async_op=True); ...; outputs = handle.wait()

shards[i] is this rank's flat shard of parameter i (1-D, padded so every rank holds the same
length n_i); outputs[i] is the flat full parameter, world * n_i elements of `dtype` (default:
the shard dtype, i.e. no cast), allocated when not given. Rank r's shard lands in
outputs[i][r * n_i : (r + 1) * n_i].

Cast before gather: each shard is cast straight into this rank's slot of its output and the
slots are then all-gathered in place (collectives.gather_slots), so a bf16/fp16 gather moves
half the bytes of an fp32 one and no full fp32 copy of the weight is ever made. One cast +
gather path serves every gather of the runtime: fill_slots then gather_slots, under the shards'
device, shared by the single form (cast_and_gather: dcr::allgather_cast, and the prefetched
dcr::allgather_cast_start / _wait, whose start is this call with async_op=True) and the packed
form (cast_and_gather_packed: a bucket, dcr::allgather_cast_bucket, in one collective).

    slot fill   CUDA: deepcompile_remat._cuda casts every shard in one launch on the current
                stream (under the shards' device), when the module is built and matches this
                torch and driver (cuda_module.usable), else torch's _foreach_copy_ into the
                slots; CPU: torch's _foreach_copy_ (faster here than our CPU kernel:
                benchmarks/scripts/bench_allgather_cast.py --cpu);
    gather      the process group's own collective, in place, NCCL coalesced into one group.

async_op=True returns a GatherHandle; its wait() returns the outputs (on CUDA it makes the
current stream wait, the host does not). Otherwise the outputs are returned, ready to use in
stream order.
"""
from __future__ import annotations

import contextlib
import datetime
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from deepcompile_remat.comm import cuda_module
from deepcompile_remat.comm.collectives import gather_slots, work_completed
from deepcompile_remat.comm.nan_policy import target_name, torch_nan_option

_CASTABLE = (torch.bfloat16, torch.float16)


def _cast_supported(src: torch.dtype, dst: torch.dtype) -> bool:
    """No cast, or float32 -> bfloat16/float16 (the casts fill_slots runs)."""
    return dst == src or (src == torch.float32 and dst in _CASTABLE)


class GatherHandle:
    """The pending gather of a bucket. wait() returns the outputs once they may be read."""

    def __init__(self, outputs: List[torch.Tensor], works=()):
        self._outputs = outputs
        self._works = list(works)
        self._done = False

    @property
    def collectives(self) -> list:
        """The collectives' works not yet waited for (empty once wait() returned)."""
        return list(self._works)

    @property
    def outputs(self) -> List[torch.Tensor]:
        """The outputs, allocated at once and readable only after wait()."""
        return self._outputs

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> List[torch.Tensor]:
        """Waits for every collective of the bucket (once; later calls return at once) and returns
        the gathered outputs. timeout: at most that long per collective, as Work.wait (None: the
        group's own timeout); a collective that times out raises the group's error."""
        if not self._done:
            for work in self._works:
                if timeout is None:
                    work.wait()
                else:
                    work.wait(timeout)
            self._works, self._done = [], True
        return self._outputs

    def is_completed(self) -> bool:
        """True when every collective has finished, without waiting."""
        return self._done or all(work_completed(w) for w in self._works)


def _world_and_rank(group) -> tuple:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _check_and_allocate(shards: Sequence[torch.Tensor], outputs, dtype, world: int):
    if len(shards) == 0:
        raise ValueError("cast_and_gather needs at least one shard")
    device = shards[0].device
    for s in shards:
        if s.dim() != 1:
            raise ValueError(f"shards must be 1-D (flat, padded), got shape {tuple(s.shape)}")
        if s.device != device or s.dtype != shards[0].dtype:
            raise ValueError("all shards of a bucket must share device and dtype")
    dtype = shards[0].dtype if dtype is None else dtype
    if not _cast_supported(shards[0].dtype, dtype):
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


def _device_guard(device: torch.device):
    """The shards' device is the current one for the cast and the collective (the eager
    backend can run a graph whose tensors live on another device than the current)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def fill_slots(shards, slots, dtype) -> None:
    """Each shard into its slot, cast to `dtype` on the way: our CUDA kernel (one launch for
    the bucket, torch's NaN bits) where usable, else torch's own multi-tensor copy."""
    casting = dtype != shards[0].dtype
    if shards[0].is_cuda and casting and cuda_module.usable():
        option = torch_nan_option("cuda", dtype)
        if option is None:
            raise RuntimeError(f"torch's CUDA NaN encoding for {dtype} matches no kernel option")
        device = shards[0].device
        shards = [s.contiguous() for s in shards]
        cuda_module.require_cuda_module().cast_into_slots(
            [s.data_ptr() for s in shards], [sl.data_ptr() for sl in slots],
            [s.numel() for s in shards], target_name(dtype), option.nan_mode,
            option.canonical_nan, torch.cuda.current_stream(device).cuda_stream)
        return
    with torch.no_grad():
        torch._foreach_copy_(list(slots), list(shards))


def cast_and_gather_packed(shards: Sequence[torch.Tensor], dtype: Optional[torch.dtype] = None,
                          group=None, async_op: bool = False):
    """A bucket in ONE collective: every shard is cast into its piece of this rank's row of one
    (world, sum of shard lengths) buffer, and the rows are gathered in place. Returns the buffer;
    parameter i is column block i of it. One collective's latency for the whole bucket, at the
    cost of a copy out per parameter (its columns are strided); cast_and_gather gathers into
    each parameter's own output instead (NCCL coalesces those into one group anyway).
    async_op=True: a GatherHandle whose wait() returns [buffer]."""
    world, rank = _world_and_rank(group)
    if len(shards) == 0:
        raise ValueError("cast_and_gather_packed needs at least one shard")
    dtype = shards[0].dtype if dtype is None else dtype
    total = sum(s.numel() for s in shards)
    buf = shards[0].new_empty(world * total, dtype=dtype)
    row = buf.view(world, total)[rank]
    with _device_guard(shards[0].device):
        pieces = list(row.split([s.numel() for s in shards]))
        fill_slots([s.reshape(-1) for s in shards], pieces, dtype)
        works = gather_slots([buf], [row], group, shards[0].device, async_op=async_op) \
            if world > 1 else []
    handle = GatherHandle([buf], works=works)
    return handle if async_op else handle.wait()[0]


# Every item of a mixed-dtype packed buffer starts at a multiple of this many bytes, so its
# piece can be viewed in any dtype (and vector loads stay aligned).
_PIECE_ALIGN = 16


def packed_byte_layout(numels: Sequence[int], dtypes: Sequence[torch.dtype]) -> tuple:
    """Where each item of a mixed-dtype packed buffer lies in one rank's row of bytes: the byte
    offsets of the items (item i holds numels[i] elements of dtypes[i]), and the row's length.
    Pure arithmetic, shared by the runtime, the fake tensors of tracing and the tests."""
    offsets, row = [], 0
    for n, dtype in zip(numels, dtypes):
        offsets.append(row)
        row += -(-int(n) * dtype.itemsize // _PIECE_ALIGN) * _PIECE_ALIGN
    return offsets, row


def check_item_casts(shards, dtypes) -> None:
    """Raises ValueError unless the shards share a device and each cast is supported."""
    if len(dtypes) != len(shards):
        raise ValueError(f"one dtype per shard: {len(dtypes)} dtypes for {len(shards)} shards")
    for i, (s, dtype) in enumerate(zip(shards, dtypes)):
        if s.device != shards[0].device:
            raise ValueError(f"shard {i} is on {s.device}, shard 0 on {shards[0].device}; a "
                             "bucket's shards must share their device")
        if not _cast_supported(s.dtype, dtype):
            raise ValueError(f"shard {i}: cast {s.dtype} -> {dtype} is not supported "
                             "(float32 -> bfloat16/float16, or no cast)")


def cast_and_gather_mixed(shards: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype],
                          group=None, async_op: bool = False):
    """A bucket whose items gather in different dtypes (say bf16-cast weights beside the fp32
    norm weights autocast keeps) in ONE collective, as FSDP2 does with its byte buffers: the
    packed buffer is bytes, (world, row) with row from packed_byte_layout; shard i is cast to
    dtypes[i] into its piece of this rank's row, then the rows are gathered in place. Returns
    the uint8 buffer (unpack_mixed gives the full parameters), or a GatherHandle whose wait()
    returns [buffer]."""
    world, rank = _world_and_rank(group)
    if len(shards) == 0:
        raise ValueError("cast_and_gather_mixed needs at least one shard")
    check_item_casts(shards, dtypes)
    numels = [s.numel() for s in shards]
    offsets, row_bytes = packed_byte_layout(numels, dtypes)
    buf = torch.empty(world * row_bytes, dtype=torch.uint8, device=shards[0].device)
    row = buf.view(world, row_bytes)[rank]
    pieces = [row[o:o + n * d.itemsize].view(d) for o, n, d in zip(offsets, numels, dtypes)]
    with _device_guard(shards[0].device):
        by_cast: dict = {}  # one fill per (shard dtype, target): a cast is one launch on CUDA
        for s, piece, d in zip(shards, pieces, dtypes):
            group_shards, group_pieces = by_cast.setdefault((s.dtype, d), ([], []))
            group_shards.append(s.reshape(-1))
            group_pieces.append(piece)
        for (_, d), (group_shards, group_pieces) in by_cast.items():
            fill_slots(group_shards, group_pieces, d)
        works = gather_slots([buf], [row], group, shards[0].device, async_op=async_op) \
            if world > 1 else []
    handle = GatherHandle([buf], works=works)
    return handle if async_op else handle.wait()[0]


def unpack_mixed(buf: torch.Tensor, numels: Sequence[int], dtypes: Sequence[torch.dtype]
                 ) -> List[torch.Tensor]:
    """The full flat parameters of a gathered mixed-dtype buffer (cast_and_gather_mixed), each
    a new tensor: rank r's slot of item i is row r's piece i."""
    offsets, row_bytes = packed_byte_layout(numels, dtypes)
    rows = buf.view(-1, row_bytes)
    return [rows[:, o:o + n * d.itemsize].clone(memory_format=torch.contiguous_format)
            .view(d).reshape(-1) for o, n, d in zip(offsets, numels, dtypes)]


def cast_and_gather(shards: Sequence[torch.Tensor], outputs: Optional[Sequence[torch.Tensor]] = None,
                   dtype: Optional[torch.dtype] = None, group=None, async_op: bool = False):
    """See the module docstring. Returns the list of outputs, or a GatherHandle."""
    world, rank = _world_and_rank(group)
    outputs, dtype = _check_and_allocate(shards, outputs, dtype, world)
    device = shards[0].device
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"cast_and_gather supports cpu and cuda tensors, not {device}")
    with _device_guard(device):
        slots = [o.view(world, -1)[rank] for o in outputs]
        fill_slots(shards, slots, dtype)
        works = gather_slots(outputs, slots, group, device, async_op=async_op) if world > 1 else []
    handle = GatherHandle(outputs, works=works)
    return handle if async_op else handle.wait()
