"""One rank's run of the matrix: for each cell, build the sharded GPT, compile it with the cell's
backend, time steps, then profile one step.

Memory is read from profiled steps after the timed ones (``profiled_steps``, each rank keeps
the one with the smallest peak; see run_cell). A step (what every figure refers to):
  forward   the compiled model under the cell's precision, then the loss (fp32 cross-entropy;
            harness/workload.py: the built-in GPT or a transformers model)
  backward  loss.backward(): the compiled backward, gradient shards reduce-scattered and
            accumulated into .grad
  release   .grad set to None (what zero_grad() does), so every step starts from the same state
No optimizer step: its memory and time are the same whatever the partition. Memory figures
are relative to the allocator's total when the step begins (sharded model and inputs already
allocated); step time is the median over the timed steps after warm-up; a barrier precedes each
timed step.

A budget cell ("ours@B", RematConfig.memory_budget) also records what budget mode decided,
summed over the step's graphs (PartitionReport.budget). A byte budget (> 1) below the smallest
legal cut fails the compile (BudgetInfeasibleError; a fraction never does, 0 is that smallest
cut); the cell then gives an infeasible row (its figures
NaN, min_budget_bytes the smallest feasible) and the matrix goes on. Every rank compiles the
same graphs and decides alike, so every rank fails at the same point, before any collective
of that graph.
"""
from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

from dcr_bench.harness import comm_wait, memory
from dcr_bench.harness.ranks import share_cores
from dcr_bench.harness.workload import Workload
from dcr_bench.profile.partitions import PartitionRecorder, PartitionStats
from dcr_bench.profile.results import BUDGET_FIELDS
from dcr_bench.profile.setups import Cell


@dataclass(frozen=True)
class RunOptions:
    """How many steps a cell runs, and how finely its memory timeline is kept."""
    warmup: int = 1  # steps after the first (compiling) one, not measured
    steps: int = 5  # timed steps (median)
    profiled_steps: int = 2  # profiled steps; the one with the smallest peak is kept
    timeline_points: int = 1500  # the memory timeline is thinned to about this many points
    op_table_dir: str = ""  # when set, rank 0 writes each cell's per-op profile there


def build_model(workload: Workload, precision: str, device):
    """The workload's model (the same full weights on every rank), sharded over the group."""
    from deepcompile_remat import zero3

    return zero3.shard(workload.build(precision, device))


def make_step(run, model, workload: Workload, precision: str, device, rank: int) -> Callable:
    """One training step of `run` on this rank's micro-batch: forward (under autocast for
    precision "autocast"), backward, gradients released, each in its record_function mark.
    The step calls after_forward, when given, between forward and backward."""
    import torch
    from torch.profiler import record_function

    batch = workload.inputs(rank, device)  # each rank its own micro-batch
    params = list(model.parameters())
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) \
        if precision == "autocast" else contextlib.nullcontext

    def step(after_forward: Optional[Callable[[], None]] = None) -> None:
        with record_function(memory.FORWARD):
            with autocast():
                loss = workload.loss(run, batch)
        if after_forward is not None:
            after_forward()
        with record_function(memory.BACKWARD):
            loss.backward()
            del loss
        with record_function(memory.RELEASE):
            for p in params:
                p.grad = None

    return step


# The measured figures of a row, NaN in an infeasible one (results.fold reads them): the step's,
# then PartitionStats.as_dict()'s numbers, taken from it so the two cannot drift apart.
MEASURED_FIELDS = ("peak_bytes", "fw_peak_bytes", "bw_peak_bytes", "boundary_bytes",
                   "start_bytes", "step_s", "compile_s", "gathered_bytes", "gather_calls",
                   "partitions",
                   *(k for k, v in PartitionStats().as_dict().items() if not isinstance(v, dict)))


def budget_figures(budget: Optional[float], reports: list) -> dict:
    """The BUDGET_FIELDS of a row: budget mode's decisions summed over the step's graphs
    (each graph has its own budget: a fraction of its own ordinary cut, or B bytes each).
    All None but infeasible=False for a cell without a budget."""
    row = dict.fromkeys(BUDGET_FIELDS)
    row.update(budget=budget, infeasible=False)
    summaries = [r.budget for r in reports if r.budget is not None]
    if budget is None or not summaries:
        return row
    row.update(
        budget_bytes=sum(b.saved_bytes_budget for b in summaries),
        budget_default_saved_bytes=sum(b.default_saved_bytes for b in summaries),
        budget_saved_bytes=sum(b.saved_bytes for b in summaries),
        recompute_flops=sum(b.recompute_cost for b in summaries),
        optimality_gap_flops=sum(b.optimality_gap for b in summaries),
        budget_graphs=len(summaries))
    return row


def budget_infeasible(err: BaseException):
    """The BudgetInfeasibleError behind `err` (torch.compile wraps what a backend raises in
    BackendCompilerFailed), or None."""
    from deepcompile_remat import BudgetInfeasibleError

    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, BudgetInfeasibleError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def infeasible_row(cell: Cell, rank: int, world: int, device, emulated: bool,
                   exact_counter: bool, min_bytes: float) -> dict:
    """The row of a budget cell whose budget is below the smallest legal cut of some graph:
    nothing measured (NaN), min_budget_bytes that graph's smallest feasible budget."""
    row = _identity(cell, rank, world, device, emulated, exact_counter)
    row.update(dict.fromkeys(MEASURED_FIELDS, float("nan")))
    row.update(peak_bytes_each_step=[], step_times_s=[], activation_bytes_per_block={},
               timeline={"t_ms": [], "bytes": [], "fw_end_ms": float("nan"),
                         "release_ms": float("nan"), "step_end_ms": float("nan")})
    row.update(budget_figures(cell.budget, []))
    row.update(infeasible=True, min_budget_bytes=float(min_bytes))
    return row


def _identity(cell: Cell, rank: int, world: int, device, emulated: bool,
              exact_counter: bool) -> dict:
    return {"backend": cell.backend, "precision": cell.precision, "setup": cell.label,
            "rank": rank, "world": world, "emulated": emulated, "device": device.type,
            "exact_counter": exact_counter}


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _write_op_table(prof, cell: Cell, world: int, emulated: bool, device, out_dir: str) -> None:
    """The cell's per-op profile (memory.op_table) to out_dir."""
    name = f"{cell.backend}-{cell.precision}-{cell.label}-w{world}{'e' if emulated else ''}.ops.txt"
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name), "w") as f:
        f.write(memory.op_table(prof, device.type, str(cell)))


def run_cell(cell: Cell, workload: Workload, opts: RunOptions, rank: int, world: int, device,
             emulated: bool, exact_counter: bool,
             progress: Optional[Callable[[str], None]] = None) -> dict:
    """Runs one cell (setup x backend x precision) on this rank: compiles, warms up, times the
    steps, profiles opts.profiled_steps more for memory (keeping the smallest peak), and
    returns the row (times, peaks, partition figures, the timeline)."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity

    from deepcompile_remat import zero3
    from deepcompile_remat.partition import clear_reports, reports

    say = progress or (lambda _msg: None)
    torch._dynamo.reset()
    clear_reports()
    recorder = PartitionRecorder()
    model = build_model(workload, cell.precision, device)
    run = torch.compile(model, backend=cell.compile_backend(recorder))
    step = make_step(run, model, workload, cell.precision, device, rank)

    say("compiling")
    t0 = time.perf_counter()
    min_bytes = None
    try:
        step()
    except Exception as err:
        infeasible = budget_infeasible(err) if cell.budget is not None else None
        if infeasible is None:
            raise
        min_bytes = float(infeasible.min_bytes)
        del infeasible  # its traceback holds the compile's frames (the model)
    if min_bytes is not None:
        del run, model, step, recorder
        gc.collect()
        torch._dynamo.reset()
        say(f"infeasible budget (min {min_bytes:.0f} bytes)")
        return infeasible_row(cell, rank, world, device, emulated, exact_counter, min_bytes)
    _sync(device)
    compile_s = time.perf_counter() - t0
    budget = budget_figures(cell.budget, reports())  # the compile's graphs only
    for i in range(opts.warmup):
        say(f"compiled in {compile_s:.1f} s; warm-up {i + 1}/{opts.warmup}")
        step()
    times, waits = [], []
    for i in range(opts.steps):
        say(f"compiled in {compile_s:.1f} s; step {i + 1}/{opts.steps}")
        dist.barrier()
        _sync(device)
        with comm_wait.blocked() as blocked:
            t0 = time.perf_counter()
            step()
            _sync(device)
            times.append(time.perf_counter() - t0)
        waits.append(blocked[0])

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    measured = []
    for i in range(opts.profiled_steps):
        say(f"profiling step {i + 1}/{opts.profiled_steps}")
        dist.barrier()
        zero3.CommStats.reset()
        gc.collect()
        with memory.profiled(activities=activities, profile_memory=True) as prof:
            step()
            _sync(device)
        if i == 0:
            gathered, calls = zero3.CommStats.allgather_bytes, zero3.CommStats.allgather_calls
            scatter_calls = zero3.CommStats.reduce_scatter_calls
        mem = memory.from_profile(prof, device.type)
        if i == 0 and opts.op_table_dir and rank == 0:
            _write_op_table(prof, cell, world, emulated, device, opts.op_table_dir)
        del prof
        if device.type == "cuda":  # exact figures from the allocator's stats: one more step
            cuda_peaks = memory.CudaStepPeaks(device)
            dist.barrier()
            cuda_peaks.begin()
            step(after_forward=cuda_peaks.forward_done)
            cuda_peaks.step_done()
            mem = cuda_peaks.apply(mem)
        measured.append(mem)
    # The step with the smallest peak: on gloo, a collective's buffer is now and then released
    # by gloo's worker thread a moment after the op returned, which adds up to one fp32 weight
    # gradient to that step's peak at random (results.json keeps every step's peak).
    mem = min(measured, key=lambda m: m.peak_bytes)
    stats = recorder.stats()
    t_ms, live = memory.downsample(mem.t_ms, mem.live_bytes, opts.timeline_points)
    row = {
        **_identity(cell, rank, world, device, emulated, exact_counter),
        "peak_bytes": mem.peak_bytes, "fw_peak_bytes": mem.fw_peak_bytes,
        "bw_peak_bytes": mem.bw_peak_bytes, "boundary_bytes": mem.boundary_bytes,
        "start_bytes": mem.start_bytes, "peak_bytes_each_step": [m.peak_bytes for m in measured],
        "step_s": statistics.median(times) if times else float("nan"), "step_times_s": times,
        "compile_s": compile_s,
        "gathered_bytes": float(gathered),  # prefetched (start/wait) gathers included
        "gather_calls": int(calls),
        "reduce_scatter_calls": int(scatter_calls),  # per step, buckets counting once
        # host time a timed step spent blocked in collectives' waits (harness/comm_wait.py)
        "comm_wait_s": statistics.median(waits) if waits else float("nan"),
        "partitions": len(recorder.partitions),
        **stats.as_dict(),
        **budget,
        "timeline": {"t_ms": t_ms, "bytes": live, "fw_end_ms": mem.fw_end_ms,
                     "release_ms": mem.release_ms, "step_end_ms": mem.bw_end_ms},
    }
    del run, model, step, recorder, measured
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":  # the next cell starts from the same allocator state
        torch.cuda.empty_cache()
    return row


class Progress:
    """One progress line on stderr (rewritten in place on a terminal)."""

    def __init__(self, total: int, prefix: str = "profile", stream=None) -> None:
        self.total, self.prefix = total, prefix
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()
        self.index = 0
        self.cell = ""

    def begin(self, index: int, cell: str) -> None:
        """Starts cell number `index`, named `cell`, and shows it."""
        self.index, self.cell = index, cell
        self("starting")

    def __call__(self, msg: str) -> None:
        line = (f"{self.prefix} [{self.index}/{self.total}] {self.cell}: {msg} "
                f"({time.perf_counter() - self.start:.0f} s)")
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        """Ends the progress line (on a terminal, moves past it)."""
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def rank_main(rank: int, nprocs: int, world: int, emulated: bool, port: int, device_kind: str,
              cells: list, workload: Workload, opts: RunOptions, show_progress: bool) -> list:
    """Entry point of one rank process (harness.ranks.spawn_for_rows): every cell, its rows."""
    import torch
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    import torch.distributed as dist

    # Every partition must be observed: a cache hit would skip the partitioner.
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    exact = memory.exact_cpu_counter() if device_kind == "cpu" else True
    share_cores(nprocs)
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    if emulated:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        # Gathered weights are this rank's slot plus uninitialized memory: denormals there
        # would slow the CPU's arithmetic by orders of magnitude (memory is unaffected).
        torch.set_flush_denormal(True)

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    else:
        dist.init_process_group("nccl" if device_kind == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    prefix = "profile" + (f" (emulated world {world})" if emulated else "")
    progress = Progress(len(cells), prefix) if (show_progress and rank == 0) else None
    rows = []
    try:
        for i, cell in enumerate(cells, 1):
            if progress:
                progress.begin(i, cell.name)
            rows.append(run_cell(cell, workload, opts, rank, world, device, emulated, exact,
                                 progress))
            if progress:
                r = rows[-1]
                if not r["infeasible"]:
                    timed = "" if r["step_s"] != r["step_s"] else f", step {r['step_s']:.2f} s"
                    progress(f"peak {r['peak_bytes'] / 2**20:.1f} MB{timed}")
        if progress:
            progress.done()
    finally:
        dist.destroy_process_group()
    return rows
