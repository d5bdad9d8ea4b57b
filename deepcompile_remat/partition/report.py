"""PartitionReport: what one partition decided and what it cost, kept per process."""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
from dataclasses import dataclass, field

log = logging.getLogger("deepcompile_remat.partition")


@dataclass(frozen=True)
class SavedValue:
    """One value the forward saves for the backward, as the report lists it."""
    name: str
    shape: tuple  # ints, or the symbolic size's formula ("s0") where dynamic
    dtype: str
    bytes: int  # at the sizes this process compiled the graph for (its size hints)
    parameter: bool  # a parameter (ZeRO-3: its shard), free to keep
    bytes_symbolic: str | None = None  # the byte size as a formula ("256*s0"); None: static


@dataclass(frozen=True)
class BudgetSummary:
    """Memory-budget mode's decision for one graph (RematConfig.memory_budget): no cut within
    saved_bytes_budget recomputes less than hull_cost_at_budget, so the chosen one is at most
    optimality_gap flops from the best."""
    saved_bytes_budget: float
    default_saved_bytes: float  # what the ordinary cut saves (a fractional budget's base)
    saved_bytes: float  # 1x bytes of the saved values, parameters free (the budget's measure)
    recompute_cost: float  # flops the backward recomputes (partition/budget.py estimate)
    hull_cost_at_budget: float
    optimality_gap: float


@dataclass(frozen=True)
class PartitionReport:
    """What one partition call decided and how long each stage took; partition.reports()
    returns the process's reports, newest last."""
    graph_nodes: int
    policy: str
    saved: tuple[SavedValue, ...]
    saved_sym_names: tuple[str, ...]  # symbolic ints (dynamic sizes) the backward receives
    recomputed: tuple[str, ...]  # forward nodes the backward computes again
    parameter_aliases: tuple[str, ...]  # nodes marked must-recompute by the ZeRO-3 rule
    saved_against_request: tuple[str, ...]  # PREFER_RECOMPUTE-tagged, saved all the same
    prepare_s: float  # DCE, CSE, torch's force-save rules
    export_s: float  # FX graph -> arrays
    solve_s: float  # C++: flow network + min cut
    extract_s: float  # forward/backward module extraction (ours; torch's where ours declines)
    forward_ops: tuple[str, ...] = field(repr=False, default=())  # call targets, graph order
    backward_ops: tuple[str, ...] = field(repr=False, default=())
    collectives: tuple[str, ...] = ()  # "fw|bw:op:dtype:numel" per gather / reduce-scatter
    schedule: tuple = ()  # per graph: the runtime's figures (zero3: schedule.ScheduleFigures)
    runtime_summary: str = ""  # the runtime's own words for the summary line ('' : none)
    budget: BudgetSummary | None = None  # budget mode's decision; None: the ordinary cut
    plan: object | None = None  # peak-target mode's decision (planning's PlanSummary); None: off
    offload: object | None = None  # activation offload's figures (OffloadFigures); None: off
    # True: torch served this compile from its AOTAutograd cache, so nothing was partitioned in
    # this process; this is the report recorded when the cache entry was written (its timings
    # are that compile's). partition/report_cache.py keeps it beside the cache.
    from_cache: bool = False
    # The rank whose cut this is, where ranks agreed on one per graph structure (planning/
    # agreement.py): this rank's own, or the first that cut it. None: not agreed (the graph's
    # collectives span no other rank, or no store).
    cut_by_rank: int | None = None
    # Where ranks agreed: (structure key, saved node ids, node info bytes, peak_target's bucket
    # sizes or None, a prefetch budget's (forward, backward) distances or None), the choices as
    # offered to them, kept with the report so that a compile served from the cache offers
    # them again.
    agreed: tuple | None = field(repr=False, default=None)

    @property
    def saved_bytes(self) -> int:
        """At the sizes this process compiled for (SavedValue.bytes)."""
        return sum(v.bytes for v in self.saved)

    @property
    def symbolic(self) -> bool:
        """Some saved size is symbolic (dynamic shapes): byte counts are at the sizes seen
        when compiling, and the cut costed each size symbol as 4096 under several ranks."""
        return any(v.bytes_symbolic is not None for v in self.saved)

    @property
    def saved_activation_bytes(self) -> int:
        """Saved bytes that are not parameters (what the step holds beyond the weights)."""
        return sum(v.bytes for v in self.saved if not v.parameter)

    def summary(self) -> str:
        """The report in one log line: sizes of the decision, then each stage's time."""
        return (f"partition: {self.graph_nodes} nodes, policy={self.policy}, saved "
                f"{len(self.saved)} tensors / {self.saved_bytes} bytes "
                f"({self.saved_activation_bytes} non-parameter), {len(self.saved_sym_names)} "
                f"symints, recomputed {len(self.recomputed)} ops, "
                f"{len(self.parameter_aliases)} parameter aliases"
                f"{' (symbolic sizes: bytes at the sizes compiled for)' if self.symbolic else ''}"
                f"; prepare "
                f"{self.prepare_s * 1e3:.1f} ms, export "
                f"{self.export_s * 1e3:.1f} ms, solve {self.solve_s * 1e3:.1f} ms, extract "
                f"{self.extract_s * 1e3:.1f} ms"
                f"{self.runtime_summary}{self._plan_summary()}"
                f"{self.offload.summary() if self.offload is not None else ''}"
                f"{'; restored with a compile served from the cache' if self.from_cache else ''}")

    def _plan_summary(self) -> str:
        """'; peak target ...' in peak-target mode (planning.peak_target.PlanSummary); '' otherwise."""
        p = self.plan
        if p is None:
            return ""
        return (f"; peak target {p.target_bytes:.0f} bytes: plan {p.family}, simulated peak "
                f"{p.predicted_peak_bytes:.0f} (at most {p.planned_bytes:.0f} with the "
                f"simulator's margin; the ordinary cut's {p.default_peak_bytes:.0f}), "
                f"{p.kept_gathers} gathered weights kept, {p.evaluated} of {p.candidates} plans "
                f"simulated")


_lock = threading.Lock()
_reports: collections.deque = collections.deque(maxlen=1000)
_collecting = threading.local()  # .lists: the lists collecting() opened in this thread


def record(report: PartitionReport, keep: int) -> None:
    """Appends `report` to this process's reports, keeping the newest `keep`, and logs its
    summary at INFO; every collecting() open in this thread sees it too."""
    global _reports
    with _lock:
        if _reports.maxlen != keep:
            _reports = collections.deque(_reports, maxlen=keep)
        _reports.append(report)
    for collected in getattr(_collecting, "lists", ()):
        collected.append(report)
    log.info("%s", report.summary())


@contextlib.contextmanager
def collecting():
    """Context manager yielding a list that receives each report this thread records while it
    is open (the partitions of one compile: it runs in the compiling thread)."""
    collected: list = []
    stack = _collecting.__dict__.setdefault("lists", [])
    stack.append(collected)
    try:
        yield collected
    finally:
        stack.remove(collected)


def reports() -> list[PartitionReport]:
    """This process's partition reports, newest last."""
    with _lock:
        return list(_reports)


def clear_reports() -> None:
    """Forgets every recorded report."""
    with _lock:
        _reports.clear()
