"""The one rank spawner: runs a function on N local processes and collects the rows they return.

Every command that measures on several ranks (profile, compare, bench-deepspeed) and the tests'
run_ranks go through spawn_for_rows. mp.spawn returns nothing, so each rank writes its rows
(JSON) to a file of its own in a temporary folder, read back in rank order once every rank has
exited. A rank that raises fails the call (mp.spawn's ProcessRaisedException names it); ranks
that hang (say, in mismatched collectives) are killed at the deadline. Ranks start as forks of
a server that has imported what every rank needs (rank_context).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import time
from typing import Callable, Optional


def free_port() -> int:
    """A free local TCP port for a process-group rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def share_cores(ranks: int) -> None:
    """Sizes this process's torch thread pool to its share of the machine's cores, for a rank
    measured beside `ranks - 1` others (OMP_NUM_THREADS is read at torch's import, too late)."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // ranks))


class RanksTimedOut(RuntimeError):
    """The ranks did not all finish before the deadline; every one was killed."""


# What every rank process imports anyway: torch's compiler and distributed stacks, the model
# library. A fork server imports them once and each rank starts as a fork of it; a fresh
# interpreter spent ~4 s of CPU a rank importing them (2 per system in `compare`). Not
# DeepSpeed: its import logs its accelerator choice to stdout, which would reach the user's
# terminal from the server.
PRELOADED = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "torch.distributed.tensor",
             "transformers.models.llama.modeling_llama")


# Variables a process sets for itself, which a rank neither needs from its parent nor reads
# before setting its own: pytest's current test, and the address inductor stores before it
# loads each compiled kernel library (codecache.py). Comparing them would make any process
# that compiled a graph in-process spawn its ranks afresh, and restart the tests' rank pools.
_PROCESS_LOCAL = frozenset({"PYTEST_CURRENT_TEST", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"})


def environment() -> dict:
    """The environment rank processes must see: this process's, less _PROCESS_LOCAL."""
    return {k: v for k, v in os.environ.items() if k not in _PROCESS_LOCAL}


_server_env: Optional[dict] = None  # the environment the fork server started with


def rank_context():
    """The multiprocessing context rank processes start from: a fork server that has imported
    PRELOADED (a module that fails to import is skipped). A forked process inherits the
    server's environment, not this process's, and some of those modules read the environment
    as they load (inductor's settings), so while this process's environment
    differs from the one the server started with, ranks are spawned as fresh interpreters
    instead. (The server cannot be restarted: every process it forked holds it alive.)"""
    import multiprocessing

    global _server_env
    env = environment()
    if _server_env is None:
        _server_env = env  # the server starts with the first forkserver process, right after
        multiprocessing.set_forkserver_preload(list(PRELOADED))
    elif env != _server_env:
        changed = sorted(k for k in env.keys() | _server_env.keys()
                         if env.get(k) != _server_env.get(k))
        logging.getLogger(__name__).info(
            "rank processes spawned afresh: the environment differs from the fork server's "
            "in %s", ", ".join(changed))
        return multiprocessing.get_context("spawn")
    return multiprocessing.get_context("forkserver")


def spawn_for_rows(fn: Callable[..., Optional[list]], nprocs: int, *args,
                   timeout_s: Optional[float] = None) -> list:
    """fn(rank, *args) -> list of JSON-able rows (None: no rows), on nprocs processes; all rows,
    rank 0 first. timeout_s: kill every rank and raise RanksTimedOut past it (None: wait)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows")
        ctx = mp.start_processes(_rows_to_file, args=(fn, out, args), nprocs=nprocs,
                                 join=False, start_method=rank_context().get_start_method())
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if deadline is not None and time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise RanksTimedOut(f"{getattr(fn, '__name__', fn)} on {nprocs} ranks did not "
                                    f"finish in {timeout_s:.0f} s")
        rows = []
        for r in range(nprocs):
            with open(f"{out}.{r}") as f:
                rows += json.load(f)
    return rows


def _rows_to_file(rank: int, fn: Callable[..., Optional[list]], out: str, args: tuple) -> None:
    rows = fn(rank, *args)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(rows or [], f)
