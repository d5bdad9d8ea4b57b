"""Issue 31: every rank process exits 0 after training and dist.destroy_process_group().

A rank that aborts at teardown ("terminate called without an active exception", SIGABRT) is a
crash to every launcher, even when its training was right. The stress test trains a small GPT
on two gloo ranks (zero3.shard + dcr.backend, SGD) and destroys the group, once per
configuration in its own pair of spawned processes, beside a CPU load; the spawner fails the
test on any rank that does not exit 0. Each rank also checks that nothing of ours holds the
group once it is destroyed: no gather in flight, and gloo's worker threads gone.

    DCR_TEARDOWN_ROUNDS=N   N rounds of every configuration (eager and inductor, fp32 and bf16);
                            default: one round of the eager ones (the default suite stays fast)
Run it on both torches: pytest tests/python/test_teardown.py, and
bash scripts/test_torch211.sh tests/python/test_teardown.py.
"""
import contextlib
import gc
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import deepcompile_remat as dcr
from deepcompile_remat import zero3
from dcr_bench.harness.models import GPT
from dist_utils import run_ranks

ROUNDS = int(os.environ.get("DCR_TEARDOWN_ROUNDS", "0"))
CONFIGS = ([(k, a) for k in ("eager", "inductor") for a in (False, True)] if ROUNDS
           else [("eager", False), ("eager", True)])
GLOO_THREAD = "pt_gloo_runloop"  # the name gloo's worker threads carry on torch 2.11 and 2.13


def _thread_names() -> list:
    names = []
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return names


def _train_sgd_then_destroy(rank, world, kind, autocast):
    torch.manual_seed(0)
    model = GPT(layers=2)
    zero3.shard(model)
    run = torch.compile(model, backend=dcr.backend(kind))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        idx = torch.randint(0, 64, (2, 16))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = run(idx).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert zero3.collectives_in_flight() == 0, "a collective was started and never waited on"
    assert GLOO_THREAD in _thread_names(), "the check below would see nothing: gloo renamed?"
    dist.destroy_process_group()
    gc.collect()
    deadline = time.monotonic() + 10.0
    while GLOO_THREAD in _thread_names() and time.monotonic() < deadline:
        time.sleep(0.1)
    # The group object dies with its last reference; its worker threads are joined then. Threads
    # still running mean someone (a work, a graph, a cache) still holds the destroyed group.
    assert GLOO_THREAD not in _thread_names(), \
        "gloo's worker threads outlive destroy_process_group: something still holds the group"


@contextlib.contextmanager
def _cpu_load(seconds: float):
    """One busy-looping process per core beside the test (each stops itself after `seconds`)."""
    burn = f"import time\nt = time.time() + {seconds}\nwhile time.time() < t: pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_two_rank_training_exits_cleanly_beside_a_cpu_load():
    """Guards against a rank aborting at teardown (issue 31): training on two gloo ranks, then
    destroy_process_group, must leave every process exiting 0, with no work of ours in flight
    and the group's threads joined, repeated for each configuration under a CPU load."""
    failures, runs = [], 0
    with _cpu_load(seconds=3600):
        for round_ in range(max(ROUNDS, 1)):
            for kind, autocast in CONFIGS:
                runs += 1
                try:
                    # Processes of its own: what is checked is how a rank process exits.
                    run_ranks(_train_sgd_then_destroy, 2, kind, autocast, fresh=True)
                except Exception as e:  # a rank killed by a signal, a failed check, a hang
                    failures.append(f"round {round_} {kind} {'bf16' if autocast else 'fp32'}: "
                                    f"{type(e).__name__}: {e}")
    assert not failures, f"{len(failures)} of {runs} runs failed:\n" + "\n".join(failures)


def _start_without_wait(rank, world):
    shard = torch.full((4,), float(rank))
    full = torch.ops.dcr.allgather_cast_start(shard, world, dist.group.WORLD.group_name, None)
    assert zero3.collectives_in_flight() == 1
    assert zero3.release_in_flight() == 1 and zero3.collectives_in_flight() == 0
    torch.testing.assert_close(full, torch.arange(world).float().repeat_interleave(4))
    assert zero3.release_in_flight() == 0


def test_release_in_flight_waits_a_gather_left_without_its_wait():
    """Guards against a gather's work outliving its step (a step that raised between
    allgather_cast_start and its wait): release_in_flight waits for it and drops it, so it is
    neither alive at destroy_process_group nor destroyed during interpreter finalization."""
    run_ranks(_start_without_wait, 2)


def test_a_rank_that_exits_with_gathers_in_flight_exits_cleanly():
    """Guards against the abort itself (issue 31), made likely: each rank starts four gathers,
    never waits for them, and exits with its group still referenced. Before the fix 5 of 10
    such runs had a rank die of SIGABRT ("terminate called without an active exception"): the
    exit hook dropped the works (later: waited for them, then dropped them, 6 of 20), so gloo's
    worker thread held the last reference and ran their destructors during finalization. Every
    process must exit 0, in each of 6 runs."""
    _every_rank_exits_0("rank_leaving_gathers_in_flight.py", runs=6)


def test_a_rank_that_ends_with_barrier_before_exit_exits_cleanly():
    """A gloo barrier keeps weak references to the group's earlier works, whose tensors are
    then freed when gloo's worker thread destroys the barrier; a process that exits right after
    a plain dist.barrier(), its group still referenced, can have that happen during
    finalization and die of SIGABRT. Measured on torch 2.13, runs with a rank aborting: this
    script with a plain dist.barrier(), 3 of 20 (5 of 20 in a variant); with
    barrier_before_exit not keeping the barrier's work, 5 of 20; as it is, 0 of 30 (and 0 of
    50 of the variant); test_zero3's param_dtype test, whose rank entry ended with a plain
    barrier, 3 of 51. (All measured before the exit hook's 50 ms yield, which covers this case
    too when the product is imported.) Every process must exit 0, in each of 12 runs."""
    _every_rank_exits_0("rank_ending_with_a_barrier.py", runs=12)



def _every_rank_exits_0(script: str, runs: int) -> None:
    """Runs `script` (in this folder) as 2 rank processes, `runs` times, each pair on a fresh
    port; fails naming every process that did not exit 0, with the end of its output."""
    from dcr_bench.harness.ranks import free_port

    script = os.path.join(os.path.dirname(__file__), script)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "OMP_NUM_THREADS": "1",  # the product from this tree, installed or not
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    failures = []
    for run in range(runs):
        port = str(free_port())
        procs = [subprocess.Popen([sys.executable, script, str(r), "2", port], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(2)]
        for r, p in enumerate(procs):
            out, _ = p.communicate(timeout=300)
            if p.returncode != 0:
                failures.append(f"run {run} rank {r}: exit {p.returncode}: {out[-400:]}")
    assert not failures, "\n".join(failures)
