"""RematConfig: the single source of truth for what deepcompile_remat does.

Built in code (``RematConfig(policy="aggressive")``) or from the ``"deepcompile_remat"`` block of a
DeepSpeed JSON config (``RematConfig.from_dict``); every field is validated on construction and
an unknown key or a bad value raises ValueError naming it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

POLICIES = ("conservative", "aggressive")
ASYNC_GATHERS = ("auto", "on", "off")


@dataclass(frozen=True)
class RematConfig:
    enabled: bool = True
    """False: the product is off. The backends compile with torch's own partitioner
    (min_cut_rematerialization_partition), no ZeRO-3 marking, no graph passes, no reports;
    what a DeepSpeed config with an absent or disabled block gets."""
    policy: str = "conservative"
    """conservative: recompute only fusible ops (pointwise, views, casts, cheap reductions).
    aggressive: recompute everything except random and compute-intensive ops."""
    mark_parameter_aliases: bool = True
    """ZeRO-3 marking: gathered, viewed and cast parameter aliases are never saved."""
    parameter_indices: Optional[Sequence[int]] = None
    """Primal indices that are parameters; None: taken from the backend (nn.Parameter inputs)
    or, failing that, AOTAutograd's static_lifetime_input_indices."""
    cast_before_gather: bool = True
    """ZeRO-3: a gather whose full-precision result is only downcast gathers the downcast
    shards instead (half the bytes; no fp32 full weight)."""
    schedule_gathers: bool = True
    """ZeRO-3: place each gather just before its first use, prefetch within the budget, and
    bucket small gathers (csrc/schedule)."""
    max_prefetch: int = 2
    """How many compute steps ahead a gather may be issued."""
    prefetch_budget_bytes: float = -1.0
    """Simulated peak a prefetch may reach; < 0: no higher than without prefetch."""
    bucket_bytes: int = 1 << 16
    """Gathers of at most this many bytes that land at one point share one collective; in the
    backward, gradients of at most this many bytes share reduce-scatters of at most this many
    bytes in all. 0: no buckets."""
    async_gathers: str = "auto"
    """Issue a gather the schedule moved ahead of its use as an async start/wait pair (torch's
    functional collectives) so communication overlaps compute. "auto": only where the
    collective runs on its own stream (NCCL); gloo on CPU shares the cores it would overlap
    with. "on" / "off": always / never. Over gloo at most one gather is in flight at a time:
    torch 2.13's functional collectives on gloo corrupt the heap with two or more
    outstanding (scripts/repro_gloo_functional_collectives.py)."""
    cse: bool = True
    """Run FX common-subexpression elimination on the joint graph before the cut."""
    keep_reports: int = 1000
    """How many PartitionReports this process keeps (oldest dropped first)."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"RematConfig.enabled must be true or false, got {self.enabled!r}")
        if self.policy not in POLICIES:
            raise ValueError(
                f"RematConfig.policy must be one of {POLICIES}, got {self.policy!r}")
        if not isinstance(self.mark_parameter_aliases, bool):
            raise ValueError("RematConfig.mark_parameter_aliases must be a bool, got "
                             f"{type(self.mark_parameter_aliases).__name__}")
        if not isinstance(self.cast_before_gather, bool):
            raise ValueError("RematConfig.cast_before_gather must be a bool, got "
                             f"{type(self.cast_before_gather).__name__}")
        if self.async_gathers not in ASYNC_GATHERS:
            raise ValueError(f"RematConfig.async_gathers must be one of {ASYNC_GATHERS}, "
                             f"got {self.async_gathers!r}")
        if not isinstance(self.cse, bool):
            raise ValueError(f"RematConfig.cse must be a bool, got {type(self.cse).__name__}")
        if self.parameter_indices is not None:
            idx = tuple(self.parameter_indices)
            for i, v in enumerate(idx):
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise ValueError(
                        f"RematConfig.parameter_indices[{i}] must be a non-negative int, got {v!r}")
            object.__setattr__(self, "parameter_indices", idx)
        for name in ("schedule_gathers",):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"RematConfig.{name} must be a bool")
        for name in ("max_prefetch", "bucket_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"RematConfig.{name} must be an int >= 0, got {v!r}")
        if not isinstance(self.prefetch_budget_bytes, (int, float)):
            raise ValueError("RematConfig.prefetch_budget_bytes must be a number")
        if not isinstance(self.keep_reports, int) or self.keep_reports < 0:
            raise ValueError(f"RematConfig.keep_reports must be an int >= 0, got {self.keep_reports!r}")

    @classmethod
    def from_dict(cls, block: Mapping[str, Any], *, where: str = "deepcompile_remat") -> "RematConfig":
        """Builds a config from a JSON block; unknown keys are errors (typos must not pass)."""
        if not isinstance(block, Mapping):
            raise ValueError(f"{where} must be a JSON object, got {type(block).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in block:
            if key not in known:
                raise ValueError(f"{where}: unknown key {key!r}; known keys: {sorted(known)}")
        try:
            return cls(**block)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    @classmethod
    def disabled(cls) -> "RematConfig":
        """The off state: torch's partitioner, nothing of ours."""
        return cls(enabled=False)
