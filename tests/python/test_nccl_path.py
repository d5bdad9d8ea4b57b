"""The NCCL branch of the runtime, proven on CPU: two ranks whose process group calls itself
NCCL (recording_pg.RecordingNccl: gloo underneath, NCCL's ordering, results only after wait(),
every collective recorded). What runs is the real Python of the GPU path: backend detection,
coalesced in-place gathers into the cast slots, async prefetch with several gathers in flight,
whole-gradient reduce-scatters; only the CUDA kernels and streams are not exercised (the slot
fill is torch's copy here, the GPU test's job: scripts/gpu_check.sh).
"""
import pytest
import torch
import torch.distributed as dist

import deepcompile_remat as dcr
import recording_pg
from deepcompile_remat import ops
from deepcompile_remat.ops import collectives
from dist_utils import run_ranks
from test_zero3 import _train_and_compare

PREFETCH = dcr.RematConfig(max_prefetch=2, prefetch_budget_bytes=1e12, bucket_bytes=0)


def _check_log(records: list, world: int) -> dict:
    """The NCCL discipline, from one rank's records; returns figures for further checks."""
    gathers = [r for r in records if r["op"] == "all_gather"]
    assert gathers, "no gather ran through the process group"
    assert all(r["in_place"] for r in gathers), "a gather whose send buffer is not its slot"
    assert all(r["coalesced"] for r in gathers), "a gather outside a coalescing group"
    depth, outstanding, most = 0, set(), 0
    for r in records:
        if r["op"] == "start_coalescing":
            depth += 1
            assert depth == 1, "coalescing groups nested"
        elif r["op"] == "end_coalescing":
            depth -= 1
            assert depth == 0 and r["size"] > 0, "an end without a start, or an empty group"
        elif r["op"] == "all_gather":
            outstanding.add(r["id"])
            most = max(most, len(outstanding))
        elif r["op"] == "wait":
            outstanding.discard(r["id"])
    assert depth == 0, "a coalescing group never ended"
    unwaited = [r for r in records if r["op"] in ("all_gather", "reduce_scatter")
                and not r.get("waited")]
    assert unwaited == [], f"collectives never waited on: {unwaited[:3]}"
    return {"most_in_flight": most,
            "reduce_scatters": sum(r["op"] == "reduce_scatter" for r in records)}


def _nccl_training(rank, world, kind):
    group = dist.group.WORLD
    assert dist.get_backend(group) == recording_pg.NAME
    assert collectives.backend_name(group, "cpu") == "nccl" and collectives.is_nccl(group, "cpu")
    recording_pg.clear()
    # "auto": async prefetch on NCCL only; here it must turn on.
    _train_and_compare(rank, world, kind, True, PREFETCH)
    records = list(recording_pg.log())
    figures = _check_log(records, world)
    reps = dcr.reports()
    assert any(s.get("async_prefetched", 0) > 0 for r in reps for s in r.schedule), \
        "async prefetch stayed off on an NCCL group"
    # On NCCL no in-flight limit: several gathers outstanding at once, in the graphs and on
    # the wire.
    assert max(s.get("max_in_flight", 0) for r in reps for s in r.schedule) > 1
    assert figures["most_in_flight"] > 1, figures
    assert figures["reduce_scatters"] > 0
    assert dist.group.WORLD.pending() == 0
    # Every rank issued the same collectives in the same order (what NCCL needs to not hang).
    sequence = [(r["op"], r.get("dtype"), r.get("numel")) for r in records if r["op"] != "wait"]
    everyone = [None] * world
    dist.all_gather_object(everyone, sequence)
    assert all(s == everyone[0] for s in everyone), "ranks issued different collectives"


@pytest.mark.parametrize("kind", ["eager", "inductor"])
def test_nccl_path_trains_like_one_process(kind):
    """Silent bugs guarded: async prefetch off on NCCL (backend read as a string), a gathered
    weight read before its wait (the recording group leaves NaN there until the wait: the
    losses and weights would not match one process), a gather that is not in place or not
    coalesced, ranks issuing different sequences."""
    run_ranks(_nccl_training, 2, kind, backend=recording_pg.NAME)


def _handles(rank, world):
    shards = [torch.full((3,), float(rank)), torch.full((5,), 10.0 + rank)]
    recording_pg.clear()
    handle = ops.allgather_cast(shards, dtype=torch.bfloat16, async_op=True)
    assert not handle.is_completed()  # NCCL-style: nothing has run yet
    outs = handle.wait()
    assert handle.is_completed()
    assert torch.equal(outs[0].float(), torch.tensor([0.0] * 3 + [1.0] * 3))
    assert torch.equal(outs[1].float(), torch.tensor([10.0] * 5 + [11.0] * 5))
    kinds = [r["op"] for r in recording_pg.log()]
    assert kinds == ["start_coalescing", "all_gather", "all_gather", "end_coalescing", "wait",
                     "wait"], kinds


def test_async_handle_on_nccl_reports_completion():
    """Before: AllGatherHandle.is_completed() raised AttributeError on NCCL (torch's coalescing
    manager has no is_completed)."""
    run_ranks(_handles, 2, backend=recording_pg.NAME)


class _FakeBackend:
    def __init__(self, name):
        self._name = name

    def name(self):
        return self._name


class _CompoundGroup:
    """What the default group is on a GPU machine: cpu:gloo,cuda:nccl."""

    def _get_backend(self, device):
        return _FakeBackend({"cpu": "gloo", "cuda": "nccl"}[device.type])

    def name(self):
        return "undefined"


class _PythonGroup:
    """A process group written in Python: no per-device backends, its own name."""

    def _get_backend(self, device):
        raise RuntimeError("No backend type associated with device type cpu")

    def name(self):
        return "NCCL"


def test_backend_is_asked_per_device():
    """Before: dist.get_backend(group) == "nccl" decided, so a compound backend
    ("cpu:gloo,cuda:nccl", the default group on GPU machines) turned async prefetch off
    silently."""
    from deepcompile_remat.zero3 import schedule

    assert collectives.backend_name(_CompoundGroup(), "cuda") == "nccl"
    assert collectives.backend_name(_CompoundGroup(), "cpu") == "gloo"
    assert collectives.backend_name(_PythonGroup(), "cpu") == "nccl"
    assert schedule._use_async({"nccl"}, "auto") and not schedule._use_async({"gloo"}, "auto")
    assert schedule._in_flight_limit({"nccl"}) is None and schedule._in_flight_limit({"gloo"}) == 1


def test_cuda_gather_runs_under_the_shards_device():
    """Before: no device guard; the eager backend can run a graph on tensors of another device
    than the current one, and the cast kernel and NCCL would then run on the wrong device.
    (Constructing the guard needs no GPU; entering it is the GPU test's.)"""
    import importlib

    module = importlib.import_module("deepcompile_remat.ops.allgather_cast")
    guard = module._device_guard(torch.device("cuda", 3))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 3
    assert not isinstance(module._device_guard(torch.device("cpu")), torch.cuda.device)


@pytest.mark.parametrize("built,torch_cuda,driver,why", [
    ("13.0.88", "13.0", 13000, None),
    ("13.0.88", "13.0", None, None),
    ("13.0.88", "12.8", 13000, "another major version"),
    ("13.0.88", "13.0", 12080, "the driver supports CUDA 12.8 at most"),
    ("12.4.1", "12.6", 12060, None),
    ("", "13.0", 13000, "recorded no CUDA version"),
])
def test_cuda_module_checked_against_torch_and_driver(built, torch_cuda, driver, why):
    """Before: the extension's build CUDA was never compared with torch.version.cuda or the
    driver; a module built for another CUDA would be launched anyway."""
    from deepcompile_remat.ops.cuda_module import incompatibility

    got = incompatibility(built, torch_cuda, driver)
    assert (got is None) if why is None else (why in got), got


def test_incompatible_cuda_module_falls_back_with_a_warning(monkeypatch, caplog):
    from deepcompile_remat.ops import cuda_module

    monkeypatch.setattr(cuda_module, "_cuda", object())  # "built and imported"
    monkeypatch.setattr(cuda_module, "cuda_build_info",
                        lambda: {"cuda_compiler_version": "12.4.1"})
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    cuda_module.usable.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="deepcompile_remat"):
            assert cuda_module.usable() is False
        assert "built with CUDA 12.4.1 but this torch uses CUDA 13.0" in caplog.text
        assert "Casting with torch" in caplog.text
    finally:
        cuda_module.usable.cache_clear()
