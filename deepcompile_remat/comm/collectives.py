"""The collectives under cast_and_gather, device-independent: which backend serves a device, and
the in-place gather of this rank's slots, issued the way that backend wants them.

    backend_name(group, "cuda")   -> "nccl" (also for "cpu:gloo,cuda:nccl" and the default group)
    gather_slots(outputs, slots, group, device, async_op) -> works to wait on

NCCL: every output is gathered in place (the slot is the send buffer: outputs[i]'s own
rank-th chunk), all of them coalesced into one NCCL group, one work for the bucket. Other
backends (gloo): one in-place gather per output, of its bytes (gloo knows neither int16 nor,
everywhere, bf16), started together when async_op, else each waited on before the next (on a
CPU nothing would overlap them anyway).

Only torch's own collectives are used, through the process group: the same communicator and
stream as every other collective of the step, on any backend. So this file's logic is the same
on GPU and CPU, and a test drives the NCCL branch on CPU with a process group that reports
itself as NCCL (tests/python/recording_pg.py).
"""
from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist


def backend_name(group, device_type: str) -> str:
    """The backend that runs `group`'s collectives on tensors of `device_type`: the backend
    object's own name, so a compound backend ("cpu:gloo,cuda:nccl", what the default group
    is on a GPU machine) answers per device. A process group written in Python answers with
    its getBackendName()."""
    group = group if group is not None else dist.group.WORLD
    try:
        return group._get_backend(torch.device(device_type)).name().lower()
    except (RuntimeError, AttributeError, ValueError):  # a Python process group: no per-device map
        return str(group.name()).lower()


def is_nccl(group, device_type: str) -> bool:
    """True when `group` runs its `device_type` collectives on NCCL."""
    return backend_name(group, device_type) == "nccl"


def _gather_single():
    # torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_slots(outputs: Sequence[torch.Tensor], slots: Sequence[torch.Tensor], group,
                 device: torch.device, *, async_op: bool) -> List:
    """All-gathers each output in place from its slot (slots[i] is outputs[i]'s rank-th chunk,
    already filled). Returns the works still to wait on (none when not async_op on gloo)."""
    gather = _gather_single()
    if is_nccl(group, device.type):
        with dist._coalescing_manager(group, device, async_ops=True) as coalesced:
            for out, slot in zip(outputs, slots):
                gather(out, slot, group=group)
        return [coalesced]  # its wait() makes the current stream wait; the host does not
    works = []
    world = dist.get_world_size(group)
    for out, slot in zip(outputs, slots):
        flat = out.view(torch.uint8)
        rank_bytes = flat.view(world, -1)[dist.get_rank(group)]
        if rank_bytes.data_ptr() != slot.data_ptr():
            raise ValueError("gather_slots: a slot is not its output's rank-th chunk")
        work = gather(flat, rank_bytes, group=group, async_op=True)
        if async_op:
            works.append(work)
        else:
            work.wait()
    return works


def work_completed(work) -> bool:
    """A work, or a coalesced group of works (torch's _CoalescingManager has no is_completed),
    finished?"""
    inner = getattr(work, "works", None)
    if inner is not None:
        return all(work_completed(w) for w in inner)
    return bool(work.is_completed())
