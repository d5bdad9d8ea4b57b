"""Runs a test function on N ranks over gloo.

Rank processes are started once per test file and world size and backend, and kept while the
file runs (a file whose cases alternate between 1 and 2 ranks starts two pools, not one a
switch): each case's function runs in them one after another (a _RankPool), each with a fresh
compile state (dynamo reset, caches off, our reports cleared, torch's seed as a new process
has it), so a case pays no process start, torch and DeepSpeed import or rendezvous (2-8 s a
case on 2 cores). A case that fails, hangs or destroys the group ends its pool (the next case
starts a new one); a case whose environment differs from the pool's (monkeypatch.setenv) or
that asks for it (fresh=True) gets processes of its own (the harness's rank spawner, a free
local port).
"""
import atexit
import contextlib
import copy
import faulthandler
import multiprocessing.connection
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from dcr_bench.harness.ranks import (RanksTimedOut, environment as _environment, free_port,
                                     rank_context, spawn_for_rows)
from deepcompile_remat.zero3.custom_ops import (barrier_before_exit, release_in_flight,
                                                resolve_group)
from deepcompile_remat.zero3.shard import specs_of


def _start_rank(rank, world, port, backend) -> None:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    faulthandler.enable()  # a crash on a rank prints where it happened
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    # One thread a rank: the ranks share the machine's cores, and idle OpenMP threads spin
    # (not the harness's share_cores: a test's tensors are too small for more threads).
    # OMP_NUM_THREADS is read when torch loads, before this runs, so it only reaches the
    # processes this rank starts (inductor's compile workers); the pool is sized here.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)


def _run_case(rank, world, fn, args) -> None:
    try:
        fn(rank, world, *args)
        if dist.is_initialized():
            # Drain every collective still queued on the group (gloo's barrier waits for all
            # prior work): DeepSpeed's prefetching gathers are never waited when no forward
            # follows, and a gloo work that finishes during interpreter finalization aborts the
            # process. A plain dist.barrier() can abort it the same way (docs/DESIGN.md,
            # "Teardown").
            barrier_before_exit()
    finally:
        # No work of ours outlives the case; no wait: a rank that failed mid-step must not hang.
        release_in_flight(wait=False)


def _entry(rank, world, port, fn, args, backend="gloo"):
    _start_rank(rank, world, port, backend)
    try:
        _run_case(rank, world, fn, args)
    finally:
        if dist.is_initialized():  # fn may destroy the group itself (test_teardown)
            dist.destroy_process_group()


# torch's default seed in a new process (torch.initial_seed()): a case run in a kept rank
# process draws the numbers it would draw in a new one.
_NEW_PROCESS_SEED = 67280421310721


def _fresh_state() -> None:
    """What a case finds in a new rank process: nothing compiled, no report, no secondary or
    replicate group set for a group by an earlier case, torch's first seed, no DeepSpeed
    autocast dtype left by an earlier engine."""
    import torch._dynamo

    import deepcompile_remat
    from deepcompile_remat.zero3 import custom_ops

    torch._dynamo.reset()
    deepcompile_remat.clear_reports()
    custom_ops._secondary_groups.clear()
    custom_ops._replicate_groups.clear()
    torch.manual_seed(_NEW_PROCESS_SEED)
    autocast = sys.modules.get("deepspeed.runtime.torch_autocast")
    if autocast is not None:
        # DeepSpeed keeps the last torch_autocast engine's dtype in module globals, never
        # reset: a later engine without autocast then sizes its reduce buckets for the wrong
        # dtypes (stage3's ipg_buckets: KeyError bfloat16). A new process starts without it.
        autocast.TORCH_AUTOCAST_INITIALIZED, autocast.TORCH_AUTOCAST_DTYPE = False, None


def _serve(rank, world, port, backend, conn) -> None:
    """A kept rank process: runs each (fn, args) it is sent, answers None or the traceback; a
    failure, or a case that destroyed the group, ends it. The group starts with the first
    case, once its module is imported (a test's own backend, recording_pg's, registers then)."""
    started = False
    while True:
        job = conn.recv()
        if job is None:
            break
        if not started:
            _start_rank(rank, world, port, backend)
            started = True
        fn, args = job
        try:
            _fresh_state()
            _run_case(rank, world, fn, args)
        except BaseException:  # noqa: BLE001 - reported to the test, then this process ends
            conn.send(f"rank {rank}: {traceback.format_exc()}")
            os._exit(1)  # a peer may wait in a collective: no clean teardown
        conn.send(None)
        if not dist.is_initialized():
            break
    if dist.is_initialized():
        dist.destroy_process_group()


class _RankPool:
    """`world` kept rank processes (module docstring), for the cases of one test file."""

    def __init__(self, world: int, backend: str, owner: str):
        self.key, self.env = (world, backend, owner), _environment()
        ctx, port = rank_context(), free_port()
        self.conns, self.procs = [], []
        for rank in range(world):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world, port, backend, theirs),
                               daemon=True)
            proc.start()
            self.conns.append(mine)
            self.procs.append(proc)

    def run(self, fn, args, timeout_s: float) -> "str | None":
        """None when every rank ran fn(rank, world, *args) through; else what went wrong (the
        pool is closed then)."""
        for conn in self.conns:
            conn.send((fn, args))
        waiting, deadline = dict(enumerate(self.conns)), time.monotonic() + timeout_s
        while waiting:
            ready = multiprocessing.connection.wait(
                list(waiting.values()), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.close()
                return "timeout"
            for rank, conn in list(waiting.items()):
                if conn in ready:
                    del waiting[rank]
                    try:
                        error = conn.recv()
                    except EOFError:
                        error = (f"rank {rank} exited with code "
                                 f"{self.procs[rank].join(5) or self.procs[rank].exitcode}")
                    if error is not None:
                        self.close()
                        return error
        return None

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # the process is gone already (BrokenPipeError)
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()


_pools: "dict[tuple, _RankPool]" = {}  # (world, backend) -> pool, all of the current file


@atexit.register
def _close_pools() -> None:
    while _pools:
        _pools.popitem()[1].close()


def _close_pool(key: tuple) -> None:
    pool = _pools.pop(key, None)
    if pool is not None:
        pool.close()


def _pool_for(world: int, backend: str, owner: str) -> _RankPool:
    if any(pool.key[2] != owner for pool in _pools.values()):
        _close_pools()  # a new file: its module's registrations start from nothing
    key = (world, backend)
    if key in _pools and not _pools[key].alive:
        _close_pool(key)
    if key not in _pools:
        _pools[key] = _RankPool(world, backend, owner)
    return _pools[key]


RANKS_TIMEOUT_S = 300.0


def run_ranks(fn, world: int = 2, *args, timeout_s: float = RANKS_TIMEOUT_S,
              backend: str = "gloo", fresh: bool = False) -> None:
    """fn(rank, world, *args) on `world` processes whose default group has `backend`; an
    assertion on any rank fails the test, and so does a run past timeout_s (ranks that disagree
    hang in a collective). The processes are the test file's kept ones (module docstring)
    unless `fresh` or the environment changed since they started."""
    pool = None if fresh else _pool_for(world, backend, fn.__module__)
    if pool is not None and pool.env != _environment():
        pool = None
    if pool is None:
        try:
            spawn_for_rows(_entry, world, world, free_port(), fn, args, backend,
                           timeout_s=timeout_s)
        except RanksTimedOut:
            error = "timeout"
        else:
            return
    else:
        error = pool.run(fn, args, timeout_s)
        if error is None:
            return
        _close_pool((world, backend))
    if error == "timeout":
        raise AssertionError(
            f"{fn.__name__} on {world} ranks did not finish in {timeout_s:.0f} s: a hang "
            "(ranks waiting in mismatched collectives?)")
    raise AssertionError(f"{fn.__name__} on {world} ranks failed:\n{error}")


def full_grads(model) -> dict:
    """name -> the full gradient of each sharded parameter, gathered from every rank."""
    out = {}
    for mod_name, mod in model.named_modules():
        for name, spec in specs_of(mod).items():
            g = mod._parameters[name].grad
            parts = [torch.zeros_like(g) for _ in range(spec.world_size)]
            dist.all_gather(parts, g, group=resolve_group(spec.group_name))
            out[f"{mod_name}.{name}".lstrip(".")] = torch.cat(parts)[: spec.numel].view(spec.shape)
    return out


def assert_trains_like_one_process(model, reference, losses, ref_losses, autocast: bool,
                                   world: int) -> None:
    """Each step's loss, averaged over ranks, and the final (gathered) state equal one
    unsharded process's, within autocast's tolerance under autocast and fp32's otherwise."""
    tol = dict(rtol=3e-2, atol=3e-2) if autocast else dict(rtol=1e-4, atol=1e-5)
    for step, (mine, ref) in enumerate(zip(losses, ref_losses)):
        dist.all_reduce(mine)
        torch.testing.assert_close(mine / world, ref, **tol, msg=lambda m: f"step {step}: {m}")
    full = model.state_dict()  # gathered on every rank
    for name, ref in reference.state_dict().items():
        torch.testing.assert_close(full[name], ref, **tol, msg=lambda m: f"{name}: {m}")


def gpt_and_batches(rank, world, layers=2, steps=3, global_batch=8, seq=16):
    """(a seeded GPT, its unsharded copy: the one-process reference, `steps` global batches of
    token ids, this rank's data-parallel slice of each)."""
    from dcr_bench.harness.models import GPT

    torch.manual_seed(0)
    model = GPT(layers=layers)
    reference = copy.deepcopy(model)
    batches = [torch.randint(0, 64, (global_batch, seq)) for _ in range(steps)]
    per_rank = global_batch // world
    return model, reference, batches, [b[rank * per_rank:(rank + 1) * per_rank] for b in batches]
