"""The NCCL branch of the runtime, proven on CPU: two ranks whose process group calls itself
NCCL (recording_pg.RecordingNccl: gloo underneath, NCCL's ordering, results only after wait(),
every collective recorded). What runs is the real Python of the GPU path: backend detection,
coalesced in-place gathers into the cast slots (per parameter, and packed buckets), async
prefetch with several gathers in flight and each waited on before its first read (checked on
the final graphs), whole-gradient and bucketed reduce-scatters, started as soon as their
gradient exists with several in flight under the backward, each waited before the graph returns
it and its send buffer untouched until then; only the CUDA kernels and
streams are not exercised (the slot fill is torch's copy here, the GPU test's job:
scripts/gpu_check.sh).
"""
import contextlib
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import deepcompile_remat as dcr
import recording_pg
from deepcompile_remat import comm
from deepcompile_remat.comm import collectives
from deepcompile_remat.fx_values import OPS
from deepcompile_remat.zero3 import custom_ops
from deepcompile_remat.zero3.passes import gather_dtype, scatter_dtype
from dist_utils import run_ranks
from graph_checks import capture_partitions, reads_before_wait
from test_zero3 import STEPS, _train_and_compare

PREFETCH = dcr.RematConfig(max_prefetch=2, prefetch_budget_bytes=1e12, bucket_bytes=0)
# The default buckets: small gathers share one collective (dcr::allgather_cast_bucket ->
# comm.cast_and_gather_packed), small gradients one reduce-scatter
# (dcr::reduce_scatter_grad_bucket).
BUCKETED = dcr.RematConfig(max_prefetch=2, prefetch_budget_bytes=1e12)
CONFIGS = {"unbucketed": PREFETCH, "bucketed": BUCKETED}

_DCR = OPS


def _check_log(records: list, world: int) -> dict:
    """The NCCL discipline, from one rank's records; returns figures for further checks."""
    gathers = [r for r in records if r["op"] == "all_gather"]
    assert gathers, "no gather ran through the process group"
    assert all(r["in_place"] for r in gathers), "a gather whose send buffer is not its slot"
    assert all(r["coalesced"] for r in gathers), "a gather outside a coalescing group"
    depth = 0
    outstanding = {"all_gather": set(), "reduce_scatter": set()}
    most = dict.fromkeys(outstanding, 0)
    for r in records:
        if r["op"] == "start_coalescing":
            depth += 1
            assert depth == 1, "coalescing groups nested"
        elif r["op"] == "end_coalescing":
            depth -= 1
            assert depth == 0 and r["size"] > 0, "an end without a start, or an empty group"
        elif r["op"] in outstanding:
            outstanding[r["op"]].add(r["id"])
            most[r["op"]] = max(most[r["op"]], len(outstanding[r["op"]]))
        elif r["op"] == "wait":
            for ids in outstanding.values():
                ids.discard(r["id"])
    assert depth == 0, "a coalescing group never ended"
    unwaited = [r for r in records if r["op"] in ("all_gather", "reduce_scatter")
                and not r.get("waited")]
    assert unwaited == [], f"collectives never waited on: {unwaited[:3]}"
    # NCCL reads a send buffer when the collective runs, any time before its wait returns.
    overwritten = [r for r in records if r.get("send_changed")]
    assert overwritten == [], f"send buffers written while in flight: {overwritten[:3]}"
    return {"most_in_flight": most["all_gather"],
            "most_scatters_in_flight": most["reduce_scatter"],
            "reduce_scatters": sum(r["op"] == "reduce_scatter" for r in records)}


def _graph_collectives(graphs, world: int) -> tuple:
    """What the graphs' bucketed gathers and all their reduce-scatters put on the wire, once
    per run of the graph: Counters of (dtype, numel) as recording_pg records them (a packed
    gather: its buffer, custom_ops.bucket_buffer; a reduce-scatter: the full gradients' elements)."""
    packed, scatters = Counter(), Counter()
    for fw, bw, _ in graphs:
        for node in [*fw.graph.nodes, *bw.graph.nodes]:
            if node.target in (_DCR.allgather_cast_bucket.default,
                               _DCR.allgather_cast_bucket_start.default):
                shards = [s.meta["val"] for s in node.args[0]]
                dtype, numel = custom_ops.bucket_buffer(shards, world, gather_dtype(node),
                                                        node.kwargs.get("item_dtypes"))
                packed[(str(dtype), numel)] += 1
            elif node.target in (_DCR.reduce_scatter_grad_bucket.default,
                                 _DCR.reduce_scatter_grad_bucket_start.default):
                grads = [g.meta["val"] for g in node.args[0]]
                scatters[(str(scatter_dtype(node)), sum(g.numel() for g in grads))] += 1
            elif node.target in (_DCR.reduce_scatter_grad.default,
                                 _DCR.reduce_scatter_grad_start.default):
                grad = node.args[0].meta["val"]
                scatters[(str(scatter_dtype(node)), grad.numel())] += 1
    return packed, scatters


def _nccl_training(rank, world, kind, config_name="unbucketed"):
    group = dist.group.WORLD
    assert dist.get_backend(group) == recording_pg.NAME
    assert collectives.backend_name(group, "cpu") == "nccl" and collectives.is_nccl(group, "cpu")
    recording_pg.clear()
    # The records each packed gather (a bucket) issued: cast_and_gather_packed waits before it
    # returns, so they are the gathers logged during the call.
    # Both packed forms: one typed buffer, or bytes for members of different dtypes.
    packed_records = []
    real = {name: getattr(comm, name)
            for name in ("cast_and_gather_packed", "cast_and_gather_mixed")}

    def spy(real_fn):
        def packed_spy(*args, **kwargs):
            before = len(recording_pg.log())
            out = real_fn(*args, **kwargs)
            packed_records.extend(r for r in recording_pg.log()[before:]
                                  if r["op"] == "all_gather")
            return out
        return packed_spy

    for name, fn in real.items():
        setattr(comm, name, spy(fn))
    try:
        # "auto": async prefetch on NCCL only; here it must turn on.
        with capture_partitions() as graphs:
            _train_and_compare(rank, world, kind, True, CONFIGS[config_name])
    finally:
        for name, fn in real.items():
            setattr(comm, name, fn)
    records = list(recording_pg.log())
    figures = _check_log(records, world)
    reps = dcr.reports()
    assert any(s.async_prefetched > 0 for r in reps for s in r.schedule), \
        "async prefetch stayed off on an NCCL group"
    # Every prefetched gather is waited on before anything reads it, in the final graphs (the
    # recording group leaves NaN in a gathered tensor until the wait, so a read before it
    # shows in the numbers too; this names the node).
    starts = [n for fw, bw, _ in graphs for gm in (fw, bw) for n in gm.graph.nodes
              if n.target in (_DCR.allgather_cast_start.default,
                              _DCR.allgather_cast_bucket_start.default)]
    assert starts, "no prefetched gather in the graphs: the wait check checked nothing"
    for fw, bw, _ in graphs:
        assert reads_before_wait(fw) == [] and reads_before_wait(bw) == []
    # What the graphs' bucketed gathers and reduce-scatters put on the wire is what went
    # through the process group, once per step (so the packed and bucketed forms ran on the
    # NCCL branch, and _check_log held for them).
    packed, scatters = _graph_collectives(graphs, world)
    got_packed = Counter((r["dtype"], r["numel"]) for r in packed_records)
    assert got_packed == Counter({k: STEPS * v for k, v in packed.items()}), (got_packed, packed)
    got_scatters = Counter((r["dtype"], r["numel"]) for r in records if r["op"] == "reduce_scatter")
    assert got_scatters == Counter({k: STEPS * v for k, v in scatters.items()}), \
        (got_scatters, scatters)
    assert figures["reduce_scatters"] > 0
    # "auto" splits every reduce-scatter on NCCL; several run under the backward at once, on
    # the wire and in the graphs, each waited before the graph returns it (reads_before_wait).
    bw_targets = Counter(n.target for _, bw, _ in graphs for n in bw.graph.nodes)
    assert bw_targets[_DCR.reduce_scatter_grad.default] == 0
    assert bw_targets[_DCR.reduce_scatter_grad_bucket.default] == 0
    assert bw_targets[_DCR.reduce_scatter_grad_start.default] + \
        bw_targets[_DCR.reduce_scatter_grad_bucket_start.default] > 0
    assert figures["most_scatters_in_flight"] > 1, figures
    assert max(s.max_reduce_scatters_in_flight for r in reps for s in r.schedule) > 1
    if config_name == "bucketed":
        assert packed_records and all(r["in_place"] and r["coalesced"] for r in packed_records)
        assert bw_targets[_DCR.reduce_scatter_grad_bucket_start.default] > 0, \
            "no gradient bucket in the backward"
        bucket_starts = sum(n.target is _DCR.allgather_cast_bucket_start.default
                            for fw, bw, _ in graphs for gm in (fw, bw) for n in gm.graph.nodes)
        assert bucket_starts > 0, "no gather bucket issued ahead of its use"
    else:
        assert not packed_records
        # On NCCL no in-flight limit: several gathers outstanding at once, in the graphs and
        # on the wire.
        assert max(s.max_in_flight for r in reps for s in r.schedule) > 1
        assert figures["most_in_flight"] > 1, figures
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
    losses and weights would not match one process; and the graphs are checked for it), a
    gather that is not in place or not coalesced, ranks issuing different sequences."""
    run_ranks(_nccl_training, 2, kind, "unbucketed", backend=recording_pg.NAME)


def test_nccl_path_with_buckets_trains_like_one_process():
    """The default buckets on the NCCL branch: the packed gather
    (dcr::allgather_cast_bucket -> cast_and_gather_packed) and the bucketed reduce-scatter
    (dcr::reduce_scatter_grad_bucket) run through the NCCL-looking group, coalesced, in place,
    waited on, the same sequence on every rank, once per step for each bucket in the graphs,
    and training matches one process. Before: only bucket_bytes=0 ran here, so neither form
    was ever issued on an NCCL group. Eager only: the collectives are the same under inductor
    (test_nccl_path_trains_like_one_process covers its start/wait placement)."""
    run_ranks(_nccl_training, 2, "eager", "bucketed", backend=recording_pg.NAME)


def test_reads_before_wait_finds_a_read_before_the_wait():
    """The graph check itself can fail: a read of a start's output placed before its wait is
    named, and a start without its wait too."""
    g = torch.fx.Graph()
    start = g.call_function(_DCR.allgather_cast_start.default, (g.placeholder("shard"), 2, "0"))
    early = g.call_function(torch.ops.aten.relu.default, (start,))
    wait = g.call_function(_DCR.allgather_cast_wait.default, (start,))
    g.output((early, g.call_function(torch.ops.aten.neg.default, (start,))))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert reads_before_wait(gm) == [f"{early.name} reads {start.name} before {wait.name}"]
    wait.append(early)
    assert reads_before_wait(gm) == []
    gm.graph.erase_node(wait)
    assert reads_before_wait(gm) == [f"{start.name} has 0 waits"]


def test_split_prefetched_waits_before_the_first_read():
    """The schedule's split of a prefetched gather (zero3/schedule.py _split_prefetched): the
    start stands where the gather stood, the wait lands before the gather's first user, and
    nothing reads the output before it; a gather used right away is left whole."""
    from deepcompile_remat.zero3.schedule import _split_prefetched

    g = torch.fx.Graph()
    shards = [g.placeholder(f"shard{i}") for i in range(2)]
    x = g.placeholder("x")
    early = g.call_function(_DCR.allgather_cast.default, (shards[0], 2, "0"))
    h = g.call_function(torch.ops.aten.relu.default, (x,))  # compute between gather and use
    view = g.call_function(torch.ops.aten.view.default, (early, [2, 4]))
    y = g.call_function(torch.ops.aten.mul.Tensor, (view, h))
    at_use = g.call_function(_DCR.allgather_cast.default, (shards[1], 2, "0"))
    z = g.call_function(torch.ops.aten.add.Tensor, (at_use, y))
    g.output((z, early))
    for gather in (early, at_use):
        gather.meta["val"] = torch.empty(8)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert _split_prefetched(gm) == 1  # at_use is used right after it: left whole
    gm.graph.lint()
    names = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert names == ["dcr.allgather_cast_start.default", "aten.relu.default",
                     "dcr.allgather_cast_wait.default", "aten.view.default", "aten.mul.Tensor",
                     "dcr.allgather_cast.default", "aten.add.Tensor"], names
    assert reads_before_wait(gm) == []


def _handles(rank, world):
    shards = [torch.full((3,), float(rank)), torch.full((5,), 10.0 + rank)]
    recording_pg.clear()
    handle = comm.cast_and_gather(shards, dtype=torch.bfloat16, async_op=True)
    assert not handle.is_completed()  # NCCL-style: nothing has run yet
    outs = handle.wait()
    assert handle.is_completed()
    assert torch.equal(outs[0].float(), torch.tensor([0.0] * 3 + [1.0] * 3))
    assert torch.equal(outs[1].float(), torch.tensor([10.0] * 5 + [11.0] * 5))
    kinds = [r["op"] for r in recording_pg.log()]
    assert kinds == ["start_coalescing", "all_gather", "all_gather", "end_coalescing", "wait",
                     "wait"], kinds


def _send_buffer_write(rank, world):
    recording_pg.clear()
    full = torch.arange(4.0 * world)
    out = torch.empty(4)
    work = dist.reduce_scatter_tensor(out, full, async_op=True)
    full.add_(1)  # written while in flight: NCCL would sum the new values
    work.wait()
    (record,) = [r for r in recording_pg.log() if r["op"] == "reduce_scatter"]
    assert record.get("send_changed"), record
    full = torch.arange(4.0 * world)
    dist.reduce_scatter_tensor(out, full, async_op=True).wait()
    assert not recording_pg.log()[-2].get("send_changed")
    assert torch.equal(out, world * torch.arange(4.0 * rank, 4.0 * rank + 4))


def test_recording_group_catches_a_send_buffer_written_in_flight():
    """The check behind "send buffers written while in flight" can fail: a reduce-scatter's
    input changed between issue and wait is recorded (an overlapped reduce-scatter whose
    full gradient the compiler freed and reused would be)."""
    run_ranks(_send_buffer_write, 2, backend=recording_pg.NAME)


def test_async_handle_on_nccl_reports_completion():
    """Before: GatherHandle.is_completed() raised AttributeError on NCCL (torch's coalescing
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
    assert schedule.use_async({"nccl"}, "auto") and not schedule.use_async({"gloo"}, "auto")
    assert schedule._in_flight_limit({"nccl"}) is None and schedule._in_flight_limit({"gloo"}) == 1


def test_cuda_gather_runs_under_the_shards_device():
    """Before: no device guard; the eager backend can run a graph on tensors of another device
    than the current one, and the cast kernel and NCCL would then run on the wrong device.
    (Constructing the guard needs no GPU; that both gathers enter it around the fill and the
    collective: test_both_gathers_fill_and_gather_inside_the_device_guard.)"""
    import importlib

    module = importlib.import_module("deepcompile_remat.comm.cast_gather")
    guard = module._device_guard(torch.device("cuda", 3))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 3
    assert not isinstance(module._device_guard(torch.device("cpu")), torch.cuda.device)


@pytest.mark.parametrize("form", ["single", "single_async", "packed"])
def test_both_gathers_fill_and_gather_inside_the_device_guard(form, monkeypatch):
    """The guard is entered, with the shards' device, around both the slot fill and the
    collective, by cast_and_gather and cast_and_gather_packed alike. Before: only the guard's
    construction was tested, so deleting a `with _device_guard(...)` failed no CPU test. World
    2 is faked (no process group): the collective is a stub that checks where it runs."""
    import importlib

    module = importlib.import_module("deepcompile_remat.comm.cast_gather")
    entered, active = [], []

    @contextlib.contextmanager
    def spy_guard(device):
        entered.append(device)
        active.append(device)
        try:
            yield
        finally:
            active.pop()

    calls = []
    real_fill = module.fill_slots

    def fill_spy(shards, slots, dtype):
        calls.append(("fill", list(active)))
        real_fill(shards, slots, dtype)

    def gather_spy(outputs, slots, group, device, *, async_op):
        calls.append(("gather", list(active)))
        return []

    monkeypatch.setattr(module, "_device_guard", spy_guard)
    monkeypatch.setattr(module, "fill_slots", fill_spy)
    monkeypatch.setattr(module, "gather_slots", gather_spy)
    monkeypatch.setattr(module, "_world_and_rank", lambda group: (2, 0))
    shards = [torch.arange(3.0), torch.arange(5.0) + 10]
    if form == "packed":
        buf = module.cast_and_gather_packed(shards, dtype=torch.bfloat16)
        assert torch.equal(buf.view(2, -1)[0].float(), torch.cat(shards))
    else:
        got = module.cast_and_gather(shards, dtype=torch.bfloat16, async_op=form == "single_async")
        outs = got.wait() if form == "single_async" else got
        assert [o.float()[:s.numel()].tolist() for o, s in zip(outs, shards)] == \
            [s.tolist() for s in shards]
    cpu = torch.device("cpu")
    assert entered == [cpu], f"{form}: guard entered with {entered}, expected the shards' device"
    assert calls == [("fill", [cpu]), ("gather", [cpu])], calls
    assert active == []


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
    from deepcompile_remat.comm.cuda_module import incompatibility

    got = incompatibility(built, torch_cuda, driver)
    assert (got is None) if why is None else (why in got), got


def test_incompatible_cuda_module_falls_back_with_a_warning(monkeypatch, caplog):
    from deepcompile_remat.comm import cuda_module

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
