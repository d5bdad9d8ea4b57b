"""Runs a function on N spawned rank processes and collects the rows they return.

mp.spawn returns nothing, so each rank writes its rows (JSON) to a file of its own in a
temporary folder, read back in rank order once every rank has exited."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Callable


def spawn_for_rows(fn: Callable[..., list], nprocs: int, *args) -> list:
    """fn(rank, *args) -> list of JSON-able rows, on nprocs processes; all rows, rank 0 first."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows")
        mp.spawn(_rows_to_file, args=(fn, out, args), nprocs=nprocs)
        rows = []
        for r in range(nprocs):
            with open(f"{out}.{r}") as f:
                rows += json.load(f)
    return rows


def _rows_to_file(rank: int, fn: Callable[..., list], out: str, args: tuple) -> None:
    rows = fn(rank, *args)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(rows, f)
