"""A process group that calls itself NCCL, for driving the NCCL code paths on CPU.

    import recording_pg                        # registers the "dcr_recording" backend
    dist.init_process_group("dcr_recording", ...)
    ...
    recording_pg.log()                         # every collective this rank issued, in order

RecordingNccl answers getBackendName() with "nccl", so every check in the runtime that asks
which backend serves a device (deepcompile_remat/ops/collectives.py) takes the NCCL branch:
coalesced in-place gathers, async prefetch with several gathers in flight, reduce-scatters of
the whole gradient. Underneath, each collective runs on a real gloo group over the same store,
so the numbers are real, and it behaves as NCCL does where it matters:

  - collectives run in the order they were issued, one after another (one NCCL stream);
  - an async collective's result exists only after wait(): until then the parts of its output
    that other ranks fill hold NaN (or 0x5A bytes), so a read before the wait shows as a wrong
    number, not as a silent race;
  - a reduce-scatter reads its send buffer when it runs, not when it is issued; a write to
    the buffer in between is recorded ("send_changed"), as the wrong sum NCCL would compute;
  - works are recorded: every collective with its dtype, sizes, whether it gathers in place
    (the send buffer is the output's own rank-th chunk), when it was waited on; coalescing
    start and end.

The backend is registered with the extended creator API (it needs the group's name, which c10d
sets only on its own backends); the device list says CPU, which is what the tensors are. Nothing here is product code: it exists for tests/python/test_nccl_path.py.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

NAME = "dcr_recording"
_LOG: list = []
# Every gloo work this module ran, kept to the end of the process. A gloo work dropped right
# after its wait can be freed, with its tensors, on gloo's worker thread; if that happens
# during interpreter finalization it aborts the rank (docs/DESIGN.md, "Teardown"): kept here,
# they are freed on the main thread. A test's ranks run a handful of collectives.
_KEPT: list = []


def _finished(work) -> None:
    """Waits for a gloo work and keeps it (see _KEPT)."""
    work.wait()
    _KEPT.append(work)


def log() -> list:
    """This process's records, oldest first: dicts with "op" and the op's facts."""
    return _LOG


def clear() -> None:
    _LOG.clear()


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.view(torch.uint8).fill_(0x5A)


class _Pending(dist.distributed_c10d.Work):
    """A collective issued and not yet run: run (with every earlier one) at wait()."""

    def __init__(self, group: "RecordingNccl", record: dict, run):
        super().__init__()
        self._group, self.record, self._run, self.done = group, record, run, False

    def wait(self, timeout=None) -> bool:
        self._group._run_until(self)
        if not self.record.get("waited"):
            self.record["waited"] = True
            _LOG.append({"op": "wait", "id": self.record["id"]})
        return True

    def is_completed(self) -> bool:
        return self.done

    def execute(self) -> None:
        if not self.done:
            self._run()
            self.done = True


class _All(dist.distributed_c10d.Work):
    """The work of a coalesced group: waits for each of its members."""

    def __init__(self, works):
        super().__init__()
        self.works = works

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class RecordingNccl(dist.ProcessGroup):
    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
        self._queue: list = []  # issued, not yet run, in issue order
        self._coalesced: list | None = None
        self._next_id = 0
        self._group_name = ""

    def getBackendName(self) -> str:
        return "nccl"

    @property
    def group_name(self) -> str:  # c10d names only its own backends' groups
        return self._group_name

    # --- issue order ----------------------------------------------------------------------------
    def _issue(self, record: dict, run) -> _Pending:
        record["id"] = self._next_id
        self._next_id += 1
        _LOG.append(record)
        work = _Pending(self, record, run)
        self._queue.append(work)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _run_until(self, work: _Pending) -> None:
        while self._queue and not work.done:
            self._queue.pop(0).execute()

    def _sync(self, record: dict, run):
        """A collective the runtime does not overlap (object collectives, barriers): issued
        after everything before it, done before it returns."""
        work = self._issue(record, run)
        work.wait()
        return work

    # --- gathers --------------------------------------------------------------------------------
    def _gather(self, out: torch.Tensor, inp: torch.Tensor) -> _Pending:
        chunk = out.view(self._size, -1)[self._rank]
        in_place = inp.data_ptr() == chunk.data_ptr() and inp.numel() == chunk.numel()
        record = {"op": "all_gather", "dtype": str(out.dtype), "numel": out.numel(),
                  "in_place": in_place, "coalesced": self._coalesced is not None}
        send = inp.detach().clone()
        for r in range(self._size):
            if r != self._rank:
                _poison(out.view(self._size, -1)[r])

        def run():
            parts = [torch.empty_like(send).view(torch.uint8) for _ in range(self._size)]
            _finished(self._gloo.allgather([parts], [send.view(torch.uint8)]))
            out.view(torch.uint8).copy_(torch.cat(parts))

        return self._issue(record, run)

    def all_gather_single(self, out, inp, opts=None):  # torch 2.13
        return self._gather(out, inp)

    def _allgather_base(self, out, inp, opts=None):  # torch 2.11
        return self._gather(out, inp)

    def all_gather_single_coalesced(self, outs, inps, opts=None):  # torch 2.13
        return _All([self._gather(o, i) for o, i in zip(outs, inps)])

    def allgather_into_tensor_coalesced(self, outs, inps, opts=None):  # torch 2.11
        return _All([self._gather(o, i) for o, i in zip(outs, inps)])

    def _start_coalescing(self, device):
        if self._coalesced is not None:
            raise AssertionError("coalescing started twice without an end")
        _LOG.append({"op": "start_coalescing", "device": str(device)})
        self._coalesced = []

    def _end_coalescing(self, device):
        if self._coalesced is None:
            raise AssertionError("coalescing ended without a start")
        works, self._coalesced = self._coalesced, None
        _LOG.append({"op": "end_coalescing", "device": str(device), "size": len(works)})
        return _All(works)

    # --- reductions -----------------------------------------------------------------------------
    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op) -> _Pending:
        record = {"op": "reduce_scatter", "dtype": str(out.dtype), "numel": inp.numel()}
        # NCCL reads the send buffer when the collective runs (here: at its wait, or when a
        # later wait runs it): a write to it while in flight is recorded, and its result used.
        send, snapshot = inp.detach(), inp.detach().clone()
        _poison(out)

        if op != dist.ReduceOp.SUM:
            raise AssertionError(f"RecordingNccl: reduce op {op} not implemented")

        def run():
            if not torch.equal(send.view(torch.uint8), snapshot.view(torch.uint8)):
                record["send_changed"] = True
            full = send.clone()
            _finished(self._gloo.allreduce([full], dist.AllreduceOptions()))
            out.copy_(full.view(self._size, -1)[self._rank])

        return self._issue(record, run)

    def reduce_scatter_single(self, out, inp, opts=None):  # torch 2.13
        return self._reduce_scatter(out, inp, opts.reduceOp if opts else dist.ReduceOp.SUM)

    def _reduce_scatter_base(self, out, inp, opts=None):  # torch 2.11
        return self._reduce_scatter(out, inp, opts.reduceOp if opts else dist.ReduceOp.SUM)

    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._sync({"op": "all_reduce", "dtype": str(tensors[0].dtype),
                           "numel": tensors[0].numel()},
                          lambda: _finished(self._gloo.allreduce(tensors, opts)))

    def allgather(self, outputs, inputs, opts=None):
        return self._sync({"op": "all_gather_list", "numel": inputs[0].numel()},
                          lambda: _finished(self._gloo.allgather(outputs, inputs)))

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._sync({"op": "broadcast", "numel": tensors[0].numel()},
                          lambda: _finished(self._gloo.broadcast(tensors, opts)))

    def barrier(self, opts=None):
        return self._sync({"op": "barrier"}, lambda: _finished(self._gloo.barrier()))

    def pending(self) -> int:
        return len(self._queue)


def _create(opts, _backend_options):
    pg = RecordingNccl(opts.store, opts.group_rank, opts.group_size, opts.timeout)
    pg._group_name = opts.group_id
    return pg


if NAME.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])
