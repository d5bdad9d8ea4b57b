"""PartitionReports that survive torch's compile caches.

With torch's AOTAutograd cache on (torch._functorch.config.enable_autograd_cache, the default,
with inductor's fx_graph_cache), a compile whose joint graph, config and inductor settings
(our partitioner's uuid among them) were seen before is served from disk: AOTAutograd never
traces the joint graph, the partitioner never runs, and reports() would miss that compile. So
each compile's reports are kept beside torch's cache (in its folder, TORCHINDUCTOR_CACHE_DIR)
under a key of what decides the partition: the partitioner's uuid (product sources, config,
parameter layout), the Dynamo graph and its inputs' shapes, dtypes and strides. A compile that
torch served from the cache records those reports again, with from_cache=True.

Inductor's FX graph cache alone never skips the partitioner: it caches the compiled forward and
backward, which are made after the cut.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import pickle
import tempfile
from typing import Any, Callable, Optional, Sequence

import torch

from deepcompile_remat.partition import report

log = logging.getLogger("deepcompile_remat.partition")
FOLDER = "deepcompile_remat_reports"  # inside inductor's cache folder


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return (f"{type(value).__name__}({tuple(value.shape)}, {tuple(value.stride())}, "
                f"{value.dtype}, {value.device.type}, {value.requires_grad})")
    return f"{type(value).__name__}({value})"  # SymInt, int, ...


def key_of(partitioner_uuid: str, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """What decides the partitions of compiling `gm` on `example_inputs` with this
    partitioner, hashed."""
    h = hashlib.sha256()
    for part in (torch.__version__, partitioner_uuid, str(gm.graph),
                 *map(_describe, example_inputs)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def caches_on() -> bool:
    """Whether torch may serve a compile from its AOTAutograd cache (so whether reports must
    be kept for it)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    return bool(functorch_config.enable_autograd_cache and inductor_config.fx_graph_cache
                and not inductor_config.force_disable_caches)


def _path(key: str) -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), FOLDER, f"{key}.pkl")


def save(key: str, reports: Sequence[report.PartitionReport]) -> None:
    """Keeps `reports` under `key` (written whole or not at all: a concurrent reader never
    sees half a file)."""
    path = _path(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        pickle.dump(tuple(reports), f)
    os.replace(tmp, path)


def load(key: str) -> tuple:
    """The reports kept under `key`; () when none are (or the file is unreadable)."""
    try:
        with open(_path(key), "rb") as f:
            kept = pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
        return ()
    return tuple(r for r in kept if isinstance(r, report.PartitionReport))


def autograd_cache_hits() -> int:
    """How many compiles torch's AOTAutograd cache has served in this process."""
    from torch._dynamo.utils import counters

    return counters["aot_autograd"]["autograd_cache_hit"]


@dataclasses.dataclass
class Served:
    """What surviving_cache_hits saw of its compile: refused is True where torch served it from
    the AOTAutograd cache and `vet` would not take the reports kept for it."""
    refused: bool = False


@contextlib.contextmanager
def surviving_cache_hits(partitioner_uuid: str, gm: torch.fx.GraphModule,
                         example_inputs: Sequence[Any], keep: int,
                         vet: Optional[Callable[[tuple], Optional[tuple]]] = None):
    """Context manager around one compile of `gm`, yielding a Served: the reports its
    partitioner records are kept under key_of(...); if torch served it from the AOTAutograd
    cache instead (no report, a cache hit), the kept ones are recorded again (from_cache=True),
    or a warning says they are missing. vet(kept reports) returns the reports to record, or
    None: the caller must not run what the cache served (Served.refused; nothing is recorded).
    With the caches off it does nothing (not even hash the graph)."""
    served = Served()
    if not caches_on():
        yield served
        return
    key = key_of(partitioner_uuid, gm, example_inputs)
    hits = autograd_cache_hits()
    with report.collecting() as fresh:
        yield served
    if fresh:
        save(key, fresh)
    elif autograd_cache_hits() > hits:
        kept = tuple(dataclasses.replace(r, from_cache=True) for r in load(key))
        kept = kept if vet is None else vet(kept)
        if kept is None:
            served.refused = True
            return
        for r in kept:
            report.record(r, keep)
        if not kept:
            log.warning("deepcompile_remat: a compile was served from torch's AOTAutograd "
                        "cache, and its partition report was not kept (%s removed?): "
                        "reports() lacks it. Clear the cache folder (TORCHINDUCTOR_CACHE_DIR) "
                        "once to record it again.", os.path.dirname(_path(key)))
