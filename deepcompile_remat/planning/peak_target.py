"""Peak-target mode: the fastest plan whose simulated peak fits (RematConfig.peak_target).

memory_budget bounds the bytes the forward saves. That is not the peak: what a cut recomputes
comes back in the backward, so the least-saving cut can peak higher than the ordinary one (at
llama 4x512 seq 1024, memory_budget 0 raised the step's peak from 138 to 179 MB). This mode
states the peak itself and plans each joint graph against it:

1. Cuts: partition/proposals.py's candidates (the ordinary cut, the hulls with and without
   the ZeRO-3 marking, points inside their edges), in ascending recompute cost. At most
   MAX_EVALUATED are built, thinned evenly over the cost order, the ordinary cut always.
2. Peak: each cut is built as it would run (extraction, then the runtime's passes with the
   configured settings) and the memory simulator (partition/simulate.py) runs the forward and
   the backward in their final order. The step's peak is the larger of the two, both counting
   the parameters (shards) as resident and the batch, the backward its saved values and
   tangents; the forward's user outputs (logits) are taken as dropped before the backward.
3. Choice: the first cut in cost order whose simulated peak fits the target with the
   simulator's measured margin (4., below). Then the
   runtime's settings: the chosen cut is built again with collective buckets BUCKET_STEP,
   BUCKET_STEP^2, ... times the configured bucket_bytes (bucket_ladder), and the largest
   whose peak still fits is kept (fewer collectives for the same bytes). The plan carries the
   settings it was built with; nothing is handed back to the runtime to override.
   A byte target no cut fits raises PeakTargetInfeasibleError naming the smallest simulated
   peak; a fraction no cut reaches takes the lowest-peak plan with a warning (PlanSummary.met
   False), as memory_budget raises a fraction to the smallest legal cut.

4. Margin: the simulator errs against the measured peak (benchmarks/README.md, "Peak-target
   mode, predicted against measured"), so a plan is taken as fitting only with room for that
   error. A byte target holds the simulated peak to target / (1 + BYTES_MARGIN): the
   simulation has run up to a fifth under the measured peak. A fraction is relative to the
   ordinary cut, whose error the plans largely share, so a plan other than the ordinary cut
   must simulate at or under T x the ordinary cut's peak / (1 + FRACTION_MARGIN), the largest
   error measured between a plan and the ordinary cut of the same graph; the ordinary cut
   itself meets any T >= 1. PlanSummary.planned_bytes is the bound applied.

The target is per compiled graph: with graph breaks, each graph is planned on its own, and the
saved values of earlier graphs in the step are not counted against a later one.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from deepcompile_remat.config import PeakTargetInfeasibleError
from deepcompile_remat.partition import fx_export
from deepcompile_remat.partition.proposals import Candidate, candidates, parameter_gathers
from deepcompile_remat.partition.simulate import step_peak
from deepcompile_remat.zero3.schedule import ScheduleOptions

log = logging.getLogger(__name__)
MAX_EVALUATED = 48  # builds per graph at most; beyond it the cuts are thinned evenly
BUCKET_STEP = 4  # bucket sizes tried: the configured one times powers of this
# The simulator's measured errors (module docstring, 4.): measured / simulated step peak above
# the inputs reached 1.20 on the CPU and 1.27 on an H100 (fp32); a plan measured 2.4% above
# the ordinary cut it simulated 8.0% under (keep-gathered, llama 4x512 seq 1024 under ZeRO-3 on
# 2 gloo ranks: 11% apart; 3.9% above on an H200 before the collectives' scratch was priced).
BYTES_MARGIN = 0.30
FRACTION_MARGIN = 0.12


@dataclass(frozen=True)
class PlanSummary:
    """Peak-target mode's decision for one graph (PartitionReport.plan). Peaks are the memory
    simulator's, in bytes, inputs (parameter shards, the batch) included."""
    target_bytes: float              # the target in bytes (not met: the lowest plan's peak)
    predicted_peak_bytes: float      # the chosen plan's step peak
    forward_peak_bytes: float
    backward_peak_bytes: float
    inputs_bytes: float              # resident throughout: the parameters (shards) it reads
    default_peak_bytes: float        # the ordinary cut's (what no target gets)
    min_peak_bytes: float            # the smallest of the plans evaluated (all: when none fit)
    family: str                      # proposals.FAMILIES
    recompute_cost: float            # flops (re-gathers at their price)
    default_recompute_cost: float
    saved_bytes: float
    kept_gathers: int                # gathered weights the forward hands the backward
    candidates: int                  # distinct cuts on the hulls
    evaluated: int                   # of them built and simulated
    met: bool = True                 # False: a fraction no plan reached; the lowest plan taken
    bucket_bytes: float = 0.0        # the collective bucket size the plan uses
    planned_bytes: float = 0.0       # the bound on the simulated peak: the target less the
    #                                  margin (module docstring, 4.)


Build = Callable[[Candidate, ScheduleOptions], tuple]
"""build(candidate, settings) -> (fw, bw, ...): the cut extracted and the runtime's passes run
with `settings`."""


@dataclass(frozen=True)
class Evaluation:
    """A candidate built with `settings` and simulated: the builder's result and the step's
    simulated peaks."""
    candidate: Candidate
    settings: ScheduleOptions
    built: tuple   # the builder's result; built[0], built[1] are the forward and backward
    peak_bytes: float
    forward_peak_bytes: float
    backward_peak_bytes: float
    inputs_bytes: float


def resolve_target(peak_target: float, default_peak_bytes: float) -> float:
    """Bytes (RematConfig.peak_target): a number <= 1 is a fraction of the ordinary cut's
    simulated peak, a number > 1 is bytes, taken as is."""
    if isinstance(peak_target, bool) or not isinstance(peak_target, (int, float)):
        raise TypeError(f"peak_target must be a number, got {type(peak_target).__name__}")
    if not math.isfinite(peak_target) or peak_target < 0:
        raise ValueError(f"peak_target must be >= 0 and finite, got {peak_target}")
    if peak_target <= 1:
        return float(peak_target) * default_peak_bytes
    return float(peak_target)


def planned_bound(peak_target: float, target: float) -> float:
    """The simulated peak a plan other than the ordinary cut must stay at or under for
    `target` bytes (module docstring, 4.)."""
    return target / (1 + (FRACTION_MARGIN if peak_target <= 1 else BYTES_MARGIN))


def _thinned(cands: list[Candidate], limit: int) -> list[Candidate]:
    """At most `limit` candidates, evenly spread over the cost order, ends kept."""
    if len(cands) <= limit:
        return cands
    picks = sorted({round(k * (len(cands) - 1) / (limit - 1)) for k in range(limit)})
    return [cands[k] for k in picks]


def evaluate(candidate: Candidate, settings: ScheduleOptions, build: Build,
             parameter_names: set[str], fuses_pointwise: bool = True) -> Evaluation:
    """Builds `candidate` with `settings` and simulates both graphs."""
    built = build(candidate, settings)
    peak, fw_peak, bw_peak, resident = step_peak(built[0], built[1], parameter_names,
                                                 fuses_pointwise)
    return Evaluation(candidate, settings, built, peak, fw_peak, bw_peak, resident)


def bucket_ladder(configured: float, gathered_bytes: float) -> list[float]:
    """Bucket sizes to try above the configured one: x4 steps from it until one bucket could
    hold every gathered weight of the graph (none when the configured size is 0: buckets
    off)."""
    sizes, size = [], configured * BUCKET_STEP
    while configured > 0 and size < BUCKET_STEP * gathered_bytes:
        sizes.append(size)
        size *= BUCKET_STEP
    return sizes


def _infeasible(peak_target, target, bound, smallest, base, graph, evaluated, total) -> None:
    """Raises for a byte target; warns for a fraction (module docstring, 3.)."""
    why = (f"peak_target {peak_target:g} asks for a peak of {target:,.0f} bytes for this "
           f"graph ({len(graph.nodes)} nodes), so a simulated peak of at most {bound:,.0f} "
           f"(the simulator's margin, planning/peak_target.py), but the smallest any plan "
           f"reaches is {smallest:,.0f} bytes ({smallest / base.peak_bytes:.3f} of the "
           f"ordinary cut's {base.peak_bytes:,.0f}; {evaluated} of {total} plans simulated)")
    if peak_target > 1:  # bytes: a limit the caller set
        needed = math.ceil(smallest * (1 + BYTES_MARGIN) * (1 + 1e-9))  # bound >= smallest
        raise PeakTargetInfeasibleError(
            f"deepcompile_remat: {why}. Set peak_target to at least {needed:,.0f} bytes "
            f"(that peak with the margin), or shard or checkpoint more.", needed)
    log.warning("deepcompile_remat: %s; using that plan.", why)


def taken_plan(taken: PlanSummary, own: PlanSummary, built: tuple, parameter_names: set[str],
               fuses_pointwise: bool = True) -> PlanSummary:
    """Another rank's plan for this graph structure (planning/agreement.py), built here: its
    choice, with this rank's target, bound and simulated peaks, met where the peak here fits
    the bound; a warning where it does not (that rank planned at its own sizes)."""
    peak, fw_peak, bw_peak, resident = step_peak(built[0], built[1], parameter_names,
                                                 fuses_pointwise)
    met = peak <= own.planned_bytes
    if not met:
        log.warning("deepcompile_remat: this rank runs the plan another rank made for the same "
                    "graph structure at its own sizes (ranks must issue the same collectives); "
                    "here it simulates a peak of %.0f bytes, over the %.0f that peak_target "
                    "allows with the margin. Pad every rank to one length or compile with "
                    "dynamic=True.", peak, own.planned_bytes)
    return dataclasses.replace(
        taken, target_bytes=own.target_bytes, planned_bytes=own.planned_bytes,
        predicted_peak_bytes=peak, forward_peak_bytes=fw_peak, backward_peak_bytes=bw_peak,
        inputs_bytes=resident, default_peak_bytes=own.default_peak_bytes,
        min_peak_bytes=own.min_peak_bytes, met=met)


def log_plan(summary: PlanSummary) -> None:
    """The plan in one INFO line."""
    log.info("deepcompile_remat: peak target %.0f bytes: plan %s, simulated peak %.0f bytes "
             "(at most %.0f with the simulator's margin; ordinary cut %.0f), recomputes %.3g "
             "flops, buckets of %.0f bytes; %d of %d plans simulated", summary.target_bytes,
             summary.family, summary.predicted_peak_bytes, summary.planned_bytes,
             summary.default_peak_bytes, summary.recompute_cost,
             summary.bucket_bytes, summary.evaluated, summary.candidates)


def plan(graph: fx_export.ExportedJointGraph, *, peak_target: float, policy: str,
         mark_parameter_aliases: bool, settings: ScheduleOptions, build: Build,
         parameter_names: set[str], fuses_pointwise: bool = True
         ) -> tuple[Evaluation, PlanSummary]:
    """The cheapest cut whose simulated peak fits `peak_target` with the configured
    `settings`, then the largest bucket size (bucket_ladder) with which it still fits
    (module docstring). Raises PeakTargetInfeasibleError where no cut fits a byte target."""
    cands = candidates(graph, policy=policy, mark_parameter_aliases=mark_parameter_aliases)
    default = next(c for c in cands if c.family == "default")
    pool = _thinned(cands, MAX_EVALUATED)
    if default not in pool:
        pool = sorted([*pool[:-1], default], key=cands.index)
    done: dict[tuple, Evaluation] = {}

    def run(c: Candidate) -> Evaluation:
        if c.saved_ids not in done:
            done[c.saved_ids] = evaluate(c, settings, build, parameter_names, fuses_pointwise)
        return done[c.saved_ids]

    base = run(default)
    target = resolve_target(peak_target, base.peak_bytes)
    bound = planned_bound(peak_target, target)

    def fits(e: Evaluation) -> bool:
        return e.peak_bytes <= bound or (e is base and peak_target == 1)

    chosen = next((e for e in map(run, pool) if fits(e)), None)
    smallest = min(e.peak_bytes for e in done.values())
    met = chosen is not None
    if not met:
        _infeasible(peak_target, target, bound, smallest, base, graph, len(done), len(cands))
        chosen = min(done.values(), key=lambda e: (e.peak_bytes, cands.index(e.candidate)))
        target = bound = chosen.peak_bytes
    c = chosen.candidate
    gathers = parameter_gathers(graph)
    gathered = float(np.asarray(graph.bytes)[gathers].sum())
    for size in bucket_ladder(settings.bucket_bytes, gathered):
        scale = size / settings.bucket_bytes  # the gradient buckets grow alike
        bigger = evaluate(c, settings.with_bucket_bytes(size, settings.grad_bucket_bytes * scale),
                          build, parameter_names, fuses_pointwise)
        if bigger.peak_bytes > max(bound, chosen.peak_bytes):
            break  # a larger bucket holds more at once: it will not fit either
        chosen = bigger
    summary = PlanSummary(
        target_bytes=target, predicted_peak_bytes=chosen.peak_bytes,
        forward_peak_bytes=chosen.forward_peak_bytes,
        backward_peak_bytes=chosen.backward_peak_bytes, inputs_bytes=chosen.inputs_bytes,
        default_peak_bytes=base.peak_bytes, min_peak_bytes=smallest, family=c.family,
        recompute_cost=c.recompute_cost, default_recompute_cost=default.recompute_cost,
        saved_bytes=c.saved_bytes, kept_gathers=int(gathers[list(c.saved_ids)].sum()),
        candidates=len(cands), evaluated=len(done), met=met,
        bucket_bytes=chosen.settings.bucket_bytes, planned_bytes=bound)
    return chosen, summary
