"""One cut per graph structure across ranks: the first rank to cut a structure decides for all.

Why: under per-rank padding each rank's first graph is static at its own length. The ordinary
cut is a pure function of the graph, so ranks at the same sizes cut alike; ranks at other sizes
cost the same structure differently, and where that flips whether an op is recomputed, it can
flip whether the backward re-gathers the parameter the op reads (a bias read only by a
recomputed add). The ranks would then issue different collectives and wait on each other
(DESIGN.md, "Ranks at their own sizes").

How: every rank that makes the ordinary cut of a joint graph, memory_budget's, or
peak_target's plan (a cut and bucket sizes), offers it under a key of the graph's structure
(everything the cut reads but the activation bytes: op classes, flags, checkpoint tags, edges,
outputs, the parameters' bytes) with the config and the process-group layout by group sizes
(Topology.shape: every rank's own secondary or replicate group is another), through the
job's c10d store (`compare_set` with an empty expected value: the first write wins, atomically,
and every later caller reads it back). A rank whose cut differs takes the stored one. The store
is not a collective: a rank that never compiles this structure, or compiles it later, waits for
no one, so ranks that recompile at other steps stay safe.

A compile served from torch's AOTAutograd cache runs a cut made in an earlier job without
cutting. Its report keeps the agreed cut (PartitionReport.agreed), and the inductor backend
offers it again on the hit (served_cuts_agree): served first, it is the job's cut, and ranks
that cut the structure later take it; a rank whose served cut lost compiles again without that
cache, before any of its collectives ran, and takes the job's.

Taking another rank's cut is always legal here: the key holds every input of the cut's
constraints (the ZeRO-3 marking, random ops, checkpoint tags and torch's must-be-in-backward
tag are flags and op classes), so the same saved set extracts the same values; only the bytes
it was priced at differ. Under memory_budget the cut that wins met the budget at its deciding
rank's sizes, and the report gives that rank's budget figures (a byte budget judged at other
sizes than this rank's: the price of one cut). Under peak_target the plan that wins is built
and simulated here too (peak_target.taken_plan): the report gives this rank's peak against
its own target, and a warning says where it does not fit. With a prefetch byte budget the
runtime's schedule chooses a distance per graph from this rank's sizes; the ranks agree on
those of the first rank too (agreed_distances), under the cut's key, and a rank whose own
differ builds its graphs again with them (ScheduleOptions.prefetch_distances).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
from typing import NamedTuple, Optional, Sequence

import numpy as np

from deepcompile_remat import _C
from deepcompile_remat.fx_arrays import ExportedJointGraph
from deepcompile_remat.partition.report import BudgetSummary, PartitionReport
from deepcompile_remat.planning.peak_target import PlanSummary

log = logging.getLogger(__name__)
KEY_PREFIX = "deepcompile_remat/cut/v1/"
_STRUCTURE_ARRAYS = ("op_class", "flags", "recompute", "ac_graph_id", "edge_tails", "edge_heads",
                     "fwd_outputs", "bwd_outputs")


def structure_key(graph: ExportedJointGraph, context: str) -> str:
    """A digest of what the cut of `graph` reads except the activation bytes, and `context`
    (the config and the topology). Parameters' bytes are in it: they are the same on every
    rank, and a layer of another width is another graph."""
    h = hashlib.sha256(context.encode())
    for name in _STRUCTURE_ARRAYS:
        a = np.ascontiguousarray(getattr(graph, name))
        h.update(f"{name}:{a.dtype.str}:{a.size};".encode())
        h.update(a.tobytes())
    flags = np.asarray(graph.flags)
    parameters = np.flatnonzero(flags & int(_C.NodeFlag.PARAMETER))
    h.update(np.asarray(graph.bytes, dtype=np.float64)[parameters].tobytes())
    return h.hexdigest()


def _rank(rank: Optional[int]) -> int:
    """`rank`, or this process's rank in the default group."""
    if rank is not None:
        return rank
    import torch.distributed as dist

    return dist.get_rank()


def default_store():
    """The job's c10d store, or None (no process group: one process, nothing to agree)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


class Cut(NamedTuple):
    """A cut as ranks offer it: the saved node ids and the node info; memory_budget's figures
    (BudgetSummary) or peak_target's plan (its PlanSummary, and the gather and gradient bucket
    sizes it was built with), both its deciding rank's, at that rank's sizes."""
    saved: list
    info: np.ndarray
    budget: Optional[BudgetSummary] = None
    plan: Optional[PlanSummary] = None
    buckets: Optional[tuple[float, float]] = None

    def same_choice(self, other: "Cut") -> bool:
        """Whether `other` saves the same values and runs with the same bucket sizes."""
        return [int(i) for i in self.saved] == [int(i) for i in other.saved] and \
            self.buckets == other.buckets


def _encode(cut: Cut, rank: int) -> bytes:
    return json.dumps({
        "rank": rank, "saved": [int(i) for i in cut.saved],
        "info": np.asarray(cut.info, np.uint8).tolist(),
        "budget": None if cut.budget is None else dataclasses.asdict(cut.budget),
        "plan": None if cut.plan is None else dataclasses.asdict(cut.plan),
        "buckets": cut.buckets,
    }).encode()


def _decode(raw: bytes) -> tuple[Cut, int]:
    d = json.loads(raw)
    return Cut(d["saved"], np.asarray(d["info"], np.uint8),
               None if d["budget"] is None else BudgetSummary(**d["budget"]),
               None if d["plan"] is None else PlanSummary(**d["plan"]),
               None if d["buckets"] is None else tuple(d["buckets"])), d["rank"]


def _first_offer(store, key: str, offer: bytes) -> Optional[bytes]:
    """What is stored under KEY_PREFIX + `key` after offering `offer` (the first offer wins),
    or None where the store cannot compare_set (torch's FakeStore: nothing is agreed, said
    once)."""
    try:
        return bytes(store.compare_set(KEY_PREFIX + key, "", offer))
    except RuntimeError as err:
        _warn_no_agreement(type(store).__name__, str(err))
        return None


def _offer(store, key: str, cut: Cut, rank: int) -> Optional[tuple[Cut, int]]:
    """(the cut stored under `key` after offering this one, the rank that offered it), or None
    where nothing can be agreed (_first_offer)."""
    stored = _first_offer(store, key, _encode(cut, rank))
    return None if stored is None else _decode(stored)


def agree(store, key: str, cut: Cut, rank: int) -> tuple[Cut, int]:
    """(the cut, the rank that decided it): this cut, offered under `key` in `store`, or the
    one a rank offered first."""
    cut = cut._replace(saved=[int(i) for i in cut.saved], info=np.asarray(cut.info, np.uint8))
    stored = _offer(store, key, cut, rank)
    if stored is None:
        return cut, rank
    (taken, by) = stored
    if taken.same_choice(cut):
        return cut, by  # with this rank's own figures, at its own sizes
    if len(taken.info) != len(cut.info):  # the key holds the node arrays: a collision or a bug
        raise RuntimeError(f"deepcompile_remat: the cut stored under {key} is for a graph of "
                           f"{len(taken.info)} nodes, this one has {len(cut.info)}")
    log.info("deepcompile_remat: rank %d takes the cut rank %d made for the same graph structure "
             "(%d saved values against its own %d; buckets %s against %s): ranks must issue "
             "the same collectives", rank, by, len(taken.saved), len(cut.saved),
             taken.buckets, cut.buckets)
    return taken, by


def served_cuts_agree(kept: Sequence[PartitionReport], *, spans_ranks: bool, store=None,
                      rank: Optional[int] = None) -> Optional[tuple[PartitionReport, ...]]:
    """A compile served from torch's AOTAutograd cache runs the cuts made when the entry was
    written, in another job, maybe agreed with ranks at other sizes: this job's ranks that
    cut the same structure must take them, or this rank must not run them. Each kept report's
    agreed cut is offered again under its key; returns the reports with this job's deciding
    rank, or None where one is not this job's cut (the caller compiles again without the
    cache, and takes the job's cut) or, where the compile's collectives span ranks, no report
    was kept to offer. store, rank: the job's (None: the default group's)."""
    if not spans_ranks:
        return tuple(kept)
    store = default_store() if store is None else store
    if store is None:
        return tuple(kept)
    if not kept:
        log.warning("deepcompile_remat: a compile was served from torch's AOTAutograd cache "
                    "without its partition report, so its cut cannot be offered to the other "
                    "ranks: compiling it again without that cache")
        return None
    rank, agreed = _rank(rank), []
    for r in kept:
        if r.agreed is None:  # one rank
            agreed.append(r)
            continue
        key, saved, info, buckets, distances = r.agreed
        served = Cut(list(saved), np.frombuffer(info, np.uint8), r.budget, r.plan, buckets)
        stored = _offer(store, key, served, rank)
        if stored is None:
            return tuple(kept)
        (taken, by) = stored
        if not taken.same_choice(served) or (
                distances is not None and
                agreed_distances(key, distances, store, rank) != tuple(distances)):
            log.info("deepcompile_remat: rank %d was served a compile from torch's AOTAutograd "
                     "cache whose cut or prefetch distances (chosen in an earlier job) are not "
                     "the ones this job's ranks agreed on for the same graph structure: "
                     "compiling it again without that cache, to take the job's", rank)
            return None
        agreed.append(dataclasses.replace(r, cut_by_rank=by))
    return tuple(agreed)


def agreed_distances(key: str, distances: tuple[int, ...], store=None,
                     rank: Optional[int] = None) -> tuple[int, ...]:
    """The prefetch distances (forward, backward) every rank runs with the cut agreed under
    `key`: this rank's, offered, or the first rank's. Only a prefetch_budget_bytes reads
    sizes to choose them (csrc/schedule/regather_schedule.h, "Collective order"): the
    distance orders the gathers among the backward's reduce-scatters."""
    store = default_store() if store is None else store
    if store is None:
        return tuple(distances)
    rank = _rank(rank)
    offer = json.dumps({"rank": rank, "distances": [int(d) for d in distances]}).encode()
    raw = _first_offer(store, f"{key}/prefetch", offer)
    if raw is None:
        return tuple(distances)
    stored = json.loads(raw)
    if tuple(stored["distances"]) != tuple(distances):
        log.info("deepcompile_remat: rank %d takes the prefetch distances %s rank %d chose for "
                 "the same graphs (its own: %s)", rank, stored["distances"], stored["rank"],
                 list(distances))
    return tuple(stored["distances"])


@functools.cache
def _warn_no_agreement(store: str, err: str) -> None:
    log.warning("deepcompile_remat: the process group's store (%s) cannot compare_set (%s), so "
                "ranks do not agree on one cut per graph structure: ranks whose graphs are "
                "static at other sizes may cut differently (planning/agreement.py)", store, err)


def agreed_cut(graph: ExportedJointGraph, cut: Cut, *, context: str, spans_ranks: bool,
               store=None) -> tuple[Cut, Optional[int], Optional[str]]:
    """The cut every rank runs for `graph` (module docstring), the rank that decided it and
    the structure key it was agreed under (both None where nothing was agreed: the graph's
    collectives span no other rank, or no store)."""
    if spans_ranks and store is None:
        store = default_store()
    if store is None or not spans_ranks:
        return cut, None, None
    key = structure_key(graph, context)
    return (*agree(store, key, cut, _rank(None)), key)
