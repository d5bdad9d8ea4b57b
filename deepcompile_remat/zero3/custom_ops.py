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
    bufs = torch.ops.dcr.allgather_cast_bucket(shards, world_size, group_name, dtype,
                                               item_dtypes=None)
    packed = torch.ops.dcr.allgather_cast_bucket_start(shards, world_size, group_name, dtype,
                                                       item_dtypes=None)
    fulls = torch.ops.dcr.allgather_cast_bucket_wait(packed, sizes, item_dtypes=None)
        a bucket of small gathers in one collective (comm.cast_and_gather_packed), whole or in
        two halves like the single gather: the start returns the packed (world, sum(sizes))
        buffer in flight, the wait completes it and returns each parameter copied out (new
        tensors: no reader of the buffer but the wait, so no mutation to declare).
        item_dtypes: a bucket whose members gather in different dtypes (bf16-cast weights and
        the fp32 norm weights autocast keeps), one code (item_dtype_codes) per member; the
        buffer is then bytes (comm.cast_and_gather_mixed) and `dtype` must be None.
    grad_shard = torch.ops.dcr.reduce_scatter_grad(full_grad, world_size, group_name, dtype)
        the average over ranks of each rank's full gradient, this rank's slot only (data
        parallel: the mean over the global batch when each rank's loss is a local mean),
        reduced in `dtype` (None: the gradient's own): a bf16 gradient of an fp32 shard is
        cast inside the op (zero3/passes.py, fold_reduce_casts), not by a kernel of its own.
    grad_shard = torch.ops.dcr.reduce_scatter_grad_start(full_grad, world_size, group_name)
    torch.ops.dcr.reduce_scatter_grad_wait(grad_shard, full_grad)
        the same in two halves (zero3/scatter_overlap.py): the start issues the collective and
        returns the shard's gradient, not yet valid; the wait (a mutation of grad_shard) waits
        and averages. The wait also takes the send buffer, full_grad, though it only holds it:
        so the compiler keeps full_grad alive, and never reuses its memory, while the
        collective reads it, and the memory simulator counts it in flight.
    grad_shards = torch.ops.dcr.reduce_scatter_grad_bucket(full_grads, world_size, group_name,
                                                           dtype)
    grad_shard, rows = torch.ops.dcr.reduce_scatter_grad_bucket_start(full_grads, world_size,
                                                                      group_name, dtype)
    grad_shards = torch.ops.dcr.reduce_scatter_grad_bucket_wait(grad_shard, rows, sizes)
        the same for several small gradients in one collective (zero3/grad_buckets.py); in two
        halves, the start packs the gradients into `rows` (the send buffer, held by the wait as
        above) and the wait splits this rank's part into one gradient per member.
    grad_shard = torch.ops.dcr.allreduce_replicas(grad_shard, replicas, group_name)
        hybrid sharding (zero3.shard(replicate_group=...)): the mean of a reduce-scattered
        gradient shard over the `replicas` ranks that hold the same shard on other replicas.
        The gather's backward issues it after the reduce-scatter (average_over_replicas).
    sec = torch.ops.dcr.secondary_shard(full, parts, group_name)
        node-local re-gathers (zero3.shard(secondary_group=...)): this rank's 1/parts slice of
        a gathered weight, at its rank in the secondary group `group_name`, kept from the
        forward; the backward re-gathers the weight from these slices within that group
        (zero3/passes.py: regather_within_secondary).

Every start is waited on in the graph that started it: nothing stays in flight across graphs
or steps (the registries below are empty whenever no graph is running).

Fake implementations give shapes for tracing; the process group is named by its group_name
(resolved on every call, so graphs hold no Python objects). The CUDA path uses the fused
kernels of deepcompile_remat.comm when they were built, else torch's own cast + collective.
"""
from __future__ import annotations

import atexit
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from deepcompile_remat import comm
from deepcompile_remat.comm.cast_gather import check_item_casts
from deepcompile_remat.comm.collectives import backend_name
from deepcompile_remat.fx_values import OP_NAMESPACE, OPS


class CommStats:
    """Bytes this process sent and received through the ops (for the measurements)."""

    allgather_bytes = 0
    reduce_scatter_bytes = 0
    allreduce_bytes = 0  # hybrid sharding's replica all-reduces
    allgather_calls = 0
    reduce_scatter_calls = 0
    allreduce_calls = 0

    @classmethod
    def reset(cls) -> None:
        """Zeroes every counter."""
        cls.allgather_bytes = cls.reduce_scatter_bytes = cls.allreduce_bytes = 0
        cls.allgather_calls = cls.reduce_scatter_calls = cls.allreduce_calls = 0


_resolved_a_group = False  # this process ran a collective of ours (see _at_exit)


def resolve_group(group_name: str):
    """The process group registered under `group_name` (graphs carry groups by name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    global _resolved_a_group
    _resolved_a_group = True
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
# Reduce-scatters started and not yet waited on, by their output's storage: (work, the flat
# send buffer, world size). The entry holds the send buffer until the wait, whoever else does.
_scatters_in_flight: dict = {}


def collectives_in_flight() -> int:
    """How many collectives of ours (gathers and reduce-scatters) a start began that no wait has
    finished yet (0 between steps; more only inside a step, or after a step that raised between
    a start and its wait)."""
    return len(_in_flight) + len(_scatters_in_flight)


EXIT_WAIT_S = 30.0  # how long, at interpreter exit, each collective still in flight is waited for


# What release_in_flight(keep=True) waited for at exit: held until the interpreter clears this
# module, long after gloo's worker threads let go of the works (see release_in_flight).
_kept_past_exit: list = []


def release_in_flight(wait: bool = True, timeout_s: Optional[float] = None,
                      keep: bool = False) -> int:
    """Drops every gather and reduce-scatter still in flight, so that no collective or work
    object of ours outlives the step that started it; returns how many there were. A step that
    raised between a start and its wait leaves one behind, holding the communicator's context:
    call this before dist.destroy_process_group(). wait=True first waits for each (timeout_s:
    at most that long each; None: the group's own timeout; every rank must have started the
    same collectives, else this blocks until then; a wait that fails or times out still drops
    the work). A dropped reduce-scatter's gradient is never averaged: only a step that raised
    leaves one, and its gradients are not to be used.

    At interpreter exit it runs through atexit, while the interpreter is whole, waiting at most
    EXIT_WAIT_S per work (a crashed peer must not turn into a hang at exit), with keep=True:
    gloo runs a work on a worker thread, which drops its own reference to the work just after
    completing it, maybe after our wait has returned. If that reference is the last (ours were
    dropped), the work's destructor runs on the worker thread and releases its tensors' Python
    objects, which takes the GIL; once finalization has begun that ends the thread inside a C++
    destructor: std::terminate, "terminate called without an active exception", SIGABRT
    (docs/DESIGN.md, "Teardown"). So the works, their handles and tensors are kept referenced
    from this module until the interpreter clears it: the worker's reference is then never the
    last, and the destructors run on the main thread."""
    import datetime

    entries = list(_in_flight.values()) + list(_scatters_in_flight.values())
    _in_flight.clear()
    _scatters_in_flight.clear()
    # Every underlying work, taken before a wait (a handle forgets its works once waited).
    works = [w for e in entries if e is not None  # None: a gather done at its start
             for w in (e.collectives if hasattr(e, "collectives") else [e[0]])
             if w is not None]
    if keep:
        _kept_past_exit.extend(entries + works)
    if wait:
        for work in works:
            try:
                if timeout_s is None:
                    work.wait()
                else:
                    work.wait(datetime.timedelta(seconds=timeout_s))
            except RuntimeError:  # the group was destroyed or aborted under it, or timeout
                pass
    return len(entries)


# At exit, after the waits: how long the main thread lets go of the GIL (see _at_exit).
EXIT_YIELD_S = 0.05


def _at_exit() -> None:
    """The exit hook: release_in_flight(keep=True) (its docstring), then a short sleep. Gloo's
    worker thread frees a finished work itself when our reference went first, and that free
    can need the GIL (the work's tensors' Python objects; the thread-local state it captured,
    which can hold Python objects). While the main thread runs Python right up to exit, such a
    worker may still be waiting for the GIL when finalization begins, and then it aborts the
    process (docs/DESIGN.md, "Teardown"). Sleeping releases the GIL: a waiting worker takes it
    and finishes while the interpreter is whole."""
    import time

    release_in_flight(wait=True, timeout_s=EXIT_WAIT_S, keep=True)
    if _resolved_a_group or (dist.is_available() and dist.is_initialized()):
        time.sleep(EXIT_YIELD_S)


atexit.register(_at_exit)


def barrier_before_exit(group=None) -> None:
    """dist.barrier(group) for a rank about to exit: every rank reaches it, every earlier work
    of the group has finished, and on gloo the process cannot then abort at exit. A gloo barrier
    keeps weak references to the group's earlier works, and a work's memory, with its tensors,
    is freed only when the last weak reference goes: when gloo's worker thread destroys the
    barrier, just after running it. If the main thread has begun interpreter finalization by
    then, freeing those tensors' Python objects needs the GIL and ends in std::terminate
    (SIGABRT; docs/DESIGN.md, "Teardown"). So the barrier's work is kept referenced from this
    module, as release_in_flight keeps its works at exit, and is freed on the main thread. Use
    it where a plain dist.barrier() would end a rank's work, before destroy_process_group."""
    work = dist.barrier(group=group, async_op=True)
    work.wait()
    _kept_past_exit.append(work)


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


def _pop(registry: dict, out: torch.Tensor, op: str, what: str):
    try:
        return registry.pop(_key(out))
    except KeyError:
        raise RuntimeError(f"{op}: no {what} in flight into this tensor (a wait without its "
                           "start, or waited twice)") from None


def _wait(full: torch.Tensor, op: str = f"{OP_NAMESPACE}::allgather_cast_wait") -> None:
    handle = _pop(_in_flight, full, op, "gather")
    if handle is not None:
        handle.wait()


def _full_like(shard, world_size, dtype):
    return shard.new_empty(world_size * shard.numel(), dtype=shard.dtype if dtype is None else dtype)


@torch.library.custom_op(f"{OP_NAMESPACE}::allgather_cast_start", mutates_args=())
def allgather_cast_start(shard: torch.Tensor, world_size: int, group_name: str,
                         dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Starts gathering `shard` from all `world_size` ranks, cast to `dtype` (None: no cast), and
    returns the full flat output, not yet readable: allgather_cast_wait on it must come before
    any use. The split lets a graph run compute between start and wait."""
    return _start(shard, world_size, group_name, dtype)


@allgather_cast_start.register_fake
def _(shard, world_size, group_name, dtype=None):
    return _full_like(shard, world_size, dtype)


@torch.library.custom_op(f"{OP_NAMESPACE}::allgather_cast_wait", mutates_args=("full",))
def allgather_cast_wait(full: torch.Tensor) -> None:
    """Waits for the gather allgather_cast_start began into `full`; a RuntimeError when none is
    in flight there."""
    _wait(full)


@allgather_cast_wait.register_fake
def _(full):
    return None


@torch.library.custom_op(f"{OP_NAMESPACE}::allgather_cast", mutates_args=())
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


def _scatter_start(full: torch.Tensor, world_size: int, group_name: str,
                   dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Starts reducing-scattering a full gradient (any shape; its numel a multiple of
    world_size) in `dtype` (None: its own); returns this rank's slot, valid after _scatter_wait
    (the mean over ranks)."""
    full = full.contiguous().reshape(-1)
    if dtype is not None and full.dtype != dtype:
        full = full.to(dtype)  # the send buffer, in the reduce dtype
    out = full.new_empty(full.numel() // world_size)
    if world_size == 1:
        out.copy_(full)
        work = None
    else:
        group = resolve_group(group_name)
        # Gloo has no AVG reduction: sum, then divide at the wait. Gloo's single-tensor
        # reduce-scatter clones the whole full gradient first (one more fp32 full weight at the
        # backward's peak); its list form reduces the chunks where they are.
        if backend_name(group, full.device.type) == "gloo":
            work = dist.reduce_scatter(out, list(full.chunk(world_size)), group=group,
                                       async_op=True)
        else:
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            work = scatter(out, full, group=group, async_op=True)
        CommStats.reduce_scatter_bytes += \
            full.numel() * full.element_size() * (world_size - 1) // world_size
        CommStats.reduce_scatter_calls += 1
    _scatters_in_flight[_key(out)] = (work, full, world_size)
    return out


def _scatter_wait(out: torch.Tensor, op: str) -> None:
    work, _, world_size = _pop(_scatters_in_flight, out, op, "reduce-scatter")
    if work is not None:
        work.wait()  # on CUDA: the current stream waits for the collective, the host does not
        out.div_(world_size)


def _reduce_scatter_mean(full: torch.Tensor, world_size: int, group_name: str,
                         dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """This rank's slot of the mean over ranks of a full gradient, in `dtype`: start, wait."""
    out = _scatter_start(full, world_size, group_name, dtype)
    _scatter_wait(out, f"{OP_NAMESPACE}::reduce_scatter_grad")
    return out


@torch.library.custom_op(f"{OP_NAMESPACE}::reduce_scatter_grad", mutates_args=())
def reduce_scatter_grad(full_grad: torch.Tensor, world_size: int, group_name: str,
                        dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """This rank's shard of the gradient averaged over the group: `full_grad` reduce-scattered
    (a copy when world_size is 1), cast to `dtype` first (None: its own dtype)."""
    return _reduce_scatter_mean(full_grad, world_size, group_name, dtype)


@torch.library.custom_op(f"{OP_NAMESPACE}::reduce_scatter_grad_start", mutates_args=())
def reduce_scatter_grad_start(full_grad: torch.Tensor, world_size: int,
                              group_name: str) -> torch.Tensor:
    """Starts reduce_scatter_grad of `full_grad` and returns this rank's shard of the
    gradient, not yet readable: reduce_scatter_grad_wait on it must come before any use, and
    `full_grad` must not be written until then."""
    return _scatter_start(full_grad, world_size, group_name)


@reduce_scatter_grad_start.register_fake
def _(full_grad, world_size, group_name):
    return full_grad.new_empty(full_grad.numel() // world_size)


@torch.library.custom_op(f"{OP_NAMESPACE}::reduce_scatter_grad_wait", mutates_args=("grad_shard",))
def reduce_scatter_grad_wait(grad_shard: torch.Tensor, full_grad: torch.Tensor,
                             after: Optional[torch.Tensor] = None) -> None:
    """Waits for the reduce-scatter reduce_scatter_grad_start began into `grad_shard` and
    averages it; `full_grad`, its send buffer, is only held (module docstring), and so is
    `after`, a tensor computed just before where the schedule placed the wait: it pins the
    wait after that compute (inductor's memory-driven reordering would otherwise run the wait
    right after its start, since it frees the send buffer). A RuntimeError when no
    reduce-scatter is in flight into `grad_shard`."""
    _scatter_wait(grad_shard, f"{OP_NAMESPACE}::reduce_scatter_grad_wait")


@reduce_scatter_grad_wait.register_fake
def _(grad_shard, full_grad, after=None):
    return None


@reduce_scatter_grad.register_fake
def _(full_grad, world_size, group_name, dtype=None):
    return full_grad.new_empty(full_grad.numel() // world_size, dtype=dtype or full_grad.dtype)


def _setup_context(ctx, inputs, output):
    shard, world_size, group_name, _ = inputs
    ctx.world_size, ctx.group_name, ctx.shard_dtype = world_size, group_name, shard.dtype


def _backward(ctx, grad):
    grad = grad.to(ctx.shard_dtype)
    shard_grad = OPS.reduce_scatter_grad(grad, ctx.world_size, ctx.group_name)
    return average_over_replicas(shard_grad, ctx.group_name), None, None, None


# Hybrid sharding: shard group -> the group of ranks holding the same shards on the other
# replicas (zero3.shard(replicate_group=...)). Keyed by the live group object, so a destroyed
# group's entry goes with it and a later group that reuses its name starts clean.
_replicate_groups: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def set_replicate_group(group, replicate_group) -> None:
    """Records that parameters sharded over `group` are replicated across `replicate_group`
    (None: not replicated). A group already recorded with another replicate group is an
    error: the gradients of the modules sharded before would be averaged over the wrong ranks."""
    known = _replicate_groups.get(group, None)
    if group in _replicate_groups and known is not replicate_group:
        def name(g):
            return "none" if g is None else f"{dist.get_process_group_ranks(g)}"
        raise ValueError(
            f"deepcompile_remat.zero3.shard: the shard group {dist.get_process_group_ranks(group)}"
            f" already holds parameters replicated across {name(known)}; sharding over it again "
            f"with replicate group {name(replicate_group)} would average their gradients over "
            f"the wrong ranks: use another shard group (dist.new_group)")
    _replicate_groups[group] = replicate_group


def replicate_group_of(group):
    """The replicate group recorded for shard group `group` (None: not replicated)."""
    return _replicate_groups.get(group, None)


def average_over_replicas(shard_grad: torch.Tensor, group_name: str) -> torch.Tensor:
    """The one step hybrid sharding adds to the gradient path: a gradient shard, already
    reduce-scattered (averaged) over its shard group `group_name`, averaged again over the
    replicate group recorded for it, so it is the mean over every data-parallel rank. A shard
    group with no replicas: `shard_grad` as it is. Runs when the backward is traced (or run
    uncompiled), so a compiled backward holds the all-reduce as a node of its own."""
    replicate = replicate_group_of(resolve_group(group_name)) if dist.is_initialized() else None
    if replicate is None:
        return shard_grad
    return OPS.allreduce_replicas(shard_grad, dist.get_world_size(replicate),
                                  replicate.group_name)


@torch.library.custom_op(f"{OP_NAMESPACE}::allreduce_replicas", mutates_args=())
def allreduce_replicas(grad_shard: torch.Tensor, replicas: int, group_name: str) -> torch.Tensor:
    """The mean of `grad_shard` over the `replicas` ranks of group `group_name` (a new
    tensor): sum all-reduce, then divide (gloo has no AVG)."""
    out = grad_shard.contiguous().clone()
    if replicas > 1:
        dist.all_reduce(out, group=resolve_group(group_name))
        out.div_(replicas)
        CommStats.allreduce_bytes += 2 * out.numel() * out.element_size() * (replicas - 1) // replicas
        CommStats.allreduce_calls += 1
    return out


@allreduce_replicas.register_fake
def _(grad_shard, replicas, group_name):
    return torch.empty_like(grad_shard, memory_format=torch.contiguous_format)


allgather_cast.register_autograd(_backward, setup_context=_setup_context)


# Node-local re-gathers (ZeRO++'s hpZ; zero3.shard(secondary_group=...)): shard group -> the
# smaller group whose ranks keep, from each forward gather, one slice of the full weight (a
# secondary shard), so the backward re-gathers within it. Keyed like _replicate_groups.
_secondary_groups: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def set_secondary_group(group, secondary_group) -> None:
    """Records that the backward re-gathers parameters sharded over `group` from secondary
    shards within `secondary_group` (None: from the shards, over `group`). A group already
    recorded with another secondary group is an error (its modules are compiled, or will be,
    with the first)."""
    if group in _secondary_groups and _secondary_groups[group] is not secondary_group:
        raise ValueError(
            f"deepcompile_remat.zero3.shard: the shard group {dist.get_process_group_ranks(group)}"
            " already re-gathers within another secondary group; use another shard group "
            "(dist.new_group) for modules with another secondary_group")
    _secondary_groups[group] = secondary_group


def secondary_group_of(group):
    """The secondary group recorded for shard group `group` (None: none)."""
    return _secondary_groups.get(group, None)


@torch.library.custom_op(f"{OP_NAMESPACE}::secondary_shard", mutates_args=())
def secondary_shard(full: torch.Tensor, parts: int, group_name: str) -> torch.Tensor:
    """This rank's slice of a gathered flat weight `full` cut into `parts` equal slices, the
    slice at its rank in group `group_name` (the secondary group): a copy, so `full` can be
    freed. dcr::allgather_cast of the slices over that group gives `full` back, bit for bit."""
    n = full.numel() // parts
    return full.narrow(0, dist.get_rank(resolve_group(group_name)) * n, n).clone()


@secondary_shard.register_fake
def _(full, parts, group_name):
    return full.new_empty(full.numel() // parts)


# A bucket's per-member dtypes travel as codes: torch.library takes no list of dtypes.
BUCKET_ITEM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def item_dtype_codes(dtypes) -> list:
    """The codes of allgather_cast_bucket's item_dtypes for these dtypes."""
    bad = [d for d in dtypes if d not in BUCKET_ITEM_DTYPES]
    if bad:
        raise ValueError(f"{OP_NAMESPACE}::allgather_cast_bucket: no item dtype code for "
                         f"{bad[0]} (codes exist for {', '.join(map(str, BUCKET_ITEM_DTYPES))})")
    return [BUCKET_ITEM_DTYPES.index(d) for d in dtypes]


def _item_dtypes(codes, n: int, op: str) -> list:
    if len(codes) != n:
        raise ValueError(f"{op}: {len(codes)} item_dtypes for {n} members")
    if any(not 0 <= c < len(BUCKET_ITEM_DTYPES) for c in codes):
        raise ValueError(f"{op}: item dtype codes must lie in [0, {len(BUCKET_ITEM_DTYPES)}), "
                         f"got {list(codes)}")
    return [BUCKET_ITEM_DTYPES[c] for c in codes]


def bucket_kwargs(shard_dtypes, gathered_dtypes) -> dict:
    """allgather_cast_bucket's dtype arguments for members with these shard and gathered
    dtypes: one typed buffer (`dtype`, None for no cast) when every member's pair is the
    first's, else a byte buffer (`item_dtypes`)."""
    pairs = set(zip(shard_dtypes, gathered_dtypes))
    if len(pairs) == 1:
        (src, dst), = pairs
        return {"dtype": None if dst == src else dst}
    return {"item_dtypes": item_dtype_codes(gathered_dtypes)}


def bucket_buffer(shards, world_size: int, dtype=None, item_dtypes=None) -> tuple:
    """(dtype, elements) of the packed buffer a bucket of these shards (tensors or fake
    tensors) gathers into: the gather dtype and world x the shards' elements, or, with
    item_dtypes, bytes (uint8) laid out by comm.packed_byte_layout."""
    if item_dtypes is None:
        return (shards[0].dtype if dtype is None else dtype), \
            world_size * sum(s.numel() for s in shards)
    dtypes = _item_dtypes(item_dtypes, len(shards), f"{OP_NAMESPACE}::allgather_cast_bucket")
    _, row_bytes = comm.packed_byte_layout([s.numel() for s in shards], dtypes)
    return torch.uint8, world_size * row_bytes


@torch.library.custom_op(f"{OP_NAMESPACE}::allgather_cast_bucket", mutates_args=())
def allgather_cast_bucket(shards: list[torch.Tensor], world_size: int, group_name: str,
                          dtype: Optional[torch.dtype] = None,
                          item_dtypes: Optional[list[int]] = None) -> list[torch.Tensor]:
    """One collective for a bucket of small parameters: every shard is cast into this rank's
    slot of one buffer, the buffer is gathered once, and each full parameter is copied out.
    Used by the schedule (zero3/schedule.py) inside already-differentiated graphs: no autograd."""
    buf = _bucket_start(shards, world_size, group_name, dtype, item_dtypes)
    return _bucket_unpack(buf, [s.numel() for s in shards], item_dtypes,
                          f"{OP_NAMESPACE}::allgather_cast_bucket")


def _bucket_start(shards, world_size: int, group_name: str, dtype, item_dtypes) -> torch.Tensor:
    """Starts the packed gather of a bucket (one collective, cast on the way); returns the
    packed buffer (bucket_buffer), registered in flight."""
    dtypes = _check_bucket(shards, dtype, item_dtypes)
    group = resolve_group(group_name) if dist.is_initialized() else None
    if dtypes is None:
        handle = comm.cast_and_gather_packed(shards, dtype, group, async_op=True)
    else:
        handle = comm.cast_and_gather_mixed(shards, dtypes, group, async_op=True)
    (buf,) = handle.outputs
    if world_size > 1:
        _count_gather(buf, world_size)
    _in_flight[_key(buf)] = handle
    return buf


def _bucket_unpack(buf: torch.Tensor, sizes: list, item_dtypes, op: str) -> list:
    """Waits for the packed gather into `buf`, then copies each full parameter out (its
    columns are strided in the buffer)."""
    _wait(buf, op)
    if item_dtypes is not None:
        return comm.unpack_mixed(buf, sizes, _item_dtypes(item_dtypes, len(sizes), op))
    rows = buf.view(-1, sum(sizes))
    return [block.reshape(-1).clone() for block in rows.split(sizes, dim=1)]


@torch.library.custom_op(f"{OP_NAMESPACE}::allgather_cast_bucket_start", mutates_args=())
def allgather_cast_bucket_start(shards: list[torch.Tensor], world_size: int, group_name: str,
                                dtype: Optional[torch.dtype] = None,
                                item_dtypes: Optional[list[int]] = None) -> torch.Tensor:
    """Starts allgather_cast_bucket; returns the packed buffer, not yet readable:
    allgather_cast_bucket_wait on it gives the full parameters."""
    return _bucket_start(shards, world_size, group_name, dtype, item_dtypes)


@allgather_cast_bucket_start.register_fake
def _(shards, world_size, group_name, dtype=None, item_dtypes=None):
    _check_bucket(shards, dtype, item_dtypes)
    buf_dtype, numel = bucket_buffer(shards, world_size, dtype, item_dtypes)
    return shards[0].new_empty(numel, dtype=buf_dtype)


# Functional, unlike the single wait: it returns new tensors (the parameters copied out) and
# nothing else reads `packed` (inductor lowers no mutating op with list outputs).
@torch.library.custom_op(f"{OP_NAMESPACE}::allgather_cast_bucket_wait", mutates_args=())
def allgather_cast_bucket_wait(packed: torch.Tensor, sizes: list[int],
                               item_dtypes: Optional[list[int]] = None) -> list[torch.Tensor]:
    """Waits for the gather allgather_cast_bucket_start began into `packed` and returns the
    full flat parameters (sizes: the shards' lengths, in order; item_dtypes: as the start's)."""
    return _bucket_unpack(packed, list(sizes), item_dtypes,
                          f"{OP_NAMESPACE}::allgather_cast_bucket_wait")


@allgather_cast_bucket_wait.register_fake
def _(packed, sizes, item_dtypes=None):
    if item_dtypes is None:
        world = packed.numel() // sum(sizes)
        return [packed.new_empty(world * n) for n in sizes]
    dtypes = _item_dtypes(item_dtypes, len(sizes), f"{OP_NAMESPACE}::allgather_cast_bucket_wait")
    _, row_bytes = comm.packed_byte_layout(sizes, dtypes)
    world = packed.numel() // row_bytes
    return [packed.new_empty(world * n, dtype=d) for n, d in zip(sizes, dtypes)]


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


def _check_bucket(shards, dtype=None, item_dtypes=None) -> Optional[list]:
    """One dtype throughout (one typed buffer), or item_dtypes (a byte buffer: any mix of the
    supported casts, one device). Returns the item dtypes decoded (None without them)."""
    op = f"{OP_NAMESPACE}::allgather_cast_bucket"
    if item_dtypes is None:
        _check_one_buffer(op, "shard", shards)
        return None
    if dtype is not None:
        raise ValueError(f"{op}: give dtype or item_dtypes, not both")
    if not shards:
        raise ValueError(f"{op}: empty bucket")
    dtypes = _item_dtypes(item_dtypes, len(shards), op)
    try:
        check_item_casts(shards, dtypes)
    except ValueError as err:
        raise ValueError(f"{op}: {err}") from None
    return dtypes


@allgather_cast_bucket.register_fake
def _(shards, world_size, group_name, dtype=None, item_dtypes=None):
    dtypes = _check_bucket(shards, dtype, item_dtypes)
    if dtypes is not None:
        return [s.new_empty(world_size * s.numel(), dtype=d) for s, d in zip(shards, dtypes)]
    return [s.new_empty(world_size * s.numel(), dtype=s.dtype if dtype is None else dtype)
            for s in shards]


@torch.library.custom_op(f"{OP_NAMESPACE}::reduce_scatter_grad_bucket", mutates_args=())
def reduce_scatter_grad_bucket(full_grads: list[torch.Tensor], world_size: int,
                               group_name: str, dtype: Optional[torch.dtype] = None
                               ) -> list[torch.Tensor]:
    """reduce_scatter_grad of each full gradient, in one collective: rank r's slots of all of
    them are laid side by side in row r of one buffer (of `dtype`, None: the gradients' own;
    each is cast as it is packed), so the buffer's r-th chunk is exactly what rank r keeps.
    Per element the same sum as one collective per gradient."""
    mine, _ = _grad_bucket_start(full_grads, world_size, group_name, dtype)
    return _grad_bucket_unpack(mine, [g.numel() // world_size for g in full_grads],
                               f"{OP_NAMESPACE}::reduce_scatter_grad_bucket")


def _grad_bucket_start(full_grads, world_size: int, group_name: str,
                       dtype: Optional[torch.dtype] = None) -> tuple:
    """Packs a bucket's gradients into rows of `dtype` (rank r's slots of all of them side by
    side in row r; each cast on the way) and starts their one reduce-scatter; returns (this
    rank's part, not yet valid; rows)."""
    _check_grad_bucket(full_grads, world_size, dtype)
    sizes = [g.numel() // world_size for g in full_grads]
    rows = full_grads[0].new_empty((world_size, sum(sizes)), dtype=dtype or full_grads[0].dtype)
    offset = 0
    for g, n in zip(full_grads, sizes):
        rows[:, offset:offset + n].copy_(g.reshape(world_size, n))
        offset += n
    return _scatter_start(rows, world_size, group_name), rows.view(-1)


def _grad_bucket_unpack(mine: torch.Tensor, sizes: list, op: str) -> list:
    _scatter_wait(mine, op)
    return [part.clone() for part in mine.split(sizes)]


@torch.library.custom_op(f"{OP_NAMESPACE}::reduce_scatter_grad_bucket_start", mutates_args=())
def reduce_scatter_grad_bucket_start(full_grads: list[torch.Tensor], world_size: int,
                                     group_name: str, dtype: Optional[torch.dtype] = None
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Starts reduce_scatter_grad_bucket; returns (this rank's part of the packed gradients,
    not yet readable; the packed send buffer, to hold until reduce_scatter_grad_bucket_wait)."""
    return _grad_bucket_start(full_grads, world_size, group_name, dtype)


@reduce_scatter_grad_bucket_start.register_fake
def _(full_grads, world_size, group_name, dtype=None):
    _check_grad_bucket(full_grads, world_size, dtype)
    total = sum(g.numel() for g in full_grads)
    dtype = dtype or full_grads[0].dtype
    return (full_grads[0].new_empty(total // world_size, dtype=dtype),
            full_grads[0].new_empty(total, dtype=dtype))


# Functional, as dcr::allgather_cast_bucket_wait: its outputs are copies, and nothing else reads
# grad_shard.
@torch.library.custom_op(f"{OP_NAMESPACE}::reduce_scatter_grad_bucket_wait", mutates_args=())
def reduce_scatter_grad_bucket_wait(grad_shard: torch.Tensor, rows: torch.Tensor,
                                    sizes: list[int], after: Optional[torch.Tensor] = None
                                    ) -> list[torch.Tensor]:
    """Waits for the reduce-scatter reduce_scatter_grad_bucket_start began into `grad_shard`
    (`rows`, its send buffer, and `after`, as in reduce_scatter_grad_wait, are only held) and
    returns each member's shard of the gradient (sizes: the members' shard lengths, in
    order)."""
    return _grad_bucket_unpack(grad_shard, list(sizes),
                               f"{OP_NAMESPACE}::reduce_scatter_grad_bucket_wait")


@reduce_scatter_grad_bucket_wait.register_fake
def _(grad_shard, rows, sizes, after=None):
    return [grad_shard.new_empty(n) for n in sizes]


def _check_grad_bucket(full_grads, world_size: int, dtype: Optional[torch.dtype] = None) -> None:
    """One send buffer: without `dtype` the gradients share theirs; with it, any floating
    dtypes, each cast as it is packed (the bf16 gradients of a layer's weights beside the fp32
    ones of its norms, reduced in fp32). One device, and whole shards, either way."""
    op = f"{OP_NAMESPACE}::reduce_scatter_grad_bucket"
    if dtype is None:
        _check_one_buffer(op, "gradient", full_grads)
    elif not full_grads:
        raise ValueError(f"{op}: empty bucket")
    for i, g in enumerate(full_grads):
        if g.device != full_grads[0].device:
            raise ValueError(f"{op}: gradient {i} is on {g.device}, gradient 0 on "
                             f"{full_grads[0].device}; a bucket's gradients share one device")
        if dtype is not None and not g.dtype.is_floating_point:
            raise ValueError(f"{op}: gradient {i} is {g.dtype}; only floating gradients are "
                             f"cast into a {dtype} bucket")
        if g.numel() % world_size:
            raise ValueError(f"{op}: gradient {i} has {g.numel()} elements, not a multiple "
                             f"of the world size {world_size}")


@reduce_scatter_grad_bucket.register_fake
def _(full_grads, world_size, group_name, dtype=None):
    _check_grad_bucket(full_grads, world_size, dtype)
    return [g.new_empty(g.numel() // world_size, dtype=dtype or g.dtype) for g in full_grads]
