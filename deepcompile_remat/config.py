"""RematConfig: the single source of truth for what deepcompile_remat does.

Built in code (``RematConfig(policy="aggressive")``, keywords only) or from the
``"deepcompile_remat"`` block of a DeepSpeed JSON config (``RematConfig.from_dict``). Every
field is checked on construction by one validator that reads the field's type: a bool must be
``true``/``false`` (not 1), a number must be a finite number (not ``true``, not NaN), a choice
must be one of its ``Literal`` values; an unknown key or a bad value raises ValueError naming the
field, what it takes and what it got.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional, Union

Policy = Literal["conservative", "aggressive"]
AsyncGathers = Literal["auto", "on", "off"]
BackendKind = Literal["eager", "inductor"]
CompileScope = Literal["auto", "layers", "model"]
Auto = Literal["auto"]  # a setting the planning layer chooses from the graph
DEFAULT_BACKEND: BackendKind = "inductor"
BACKEND_KINDS: tuple[str, ...] = typing.get_args(BackendKind)  # what backend(kind) takes


@dataclass(frozen=True, kw_only=True, slots=True)
class RematConfig:
    """Everything deepcompile_remat does, in one frozen object: the backends, zero3.shard and
    the DeepSpeed takeover all read it. Fields are documented one by one below; construction
    checks every field (see the module docstring)."""
    enabled: bool = True
    """false: the product is off; the backends compile with torch's own partitioner and
    nothing of ours runs (what a DeepSpeed config with an absent or disabled block gets).

    Off means min_cut_rematerialization_partition, no ZeRO-3 marking, no graph passes, no
    reports."""
    policy: Policy = "conservative"
    """conservative: recompute only fusible ops (pointwise, views, casts, cheap reductions),
    never a reduction that reads 4x the bytes it writes or more (norm statistics, log-sum-exp:
    saved instead, as torch's partitioner does). aggressive: recompute everything except random and compute-intensive ops. A checkpoint
    region's tags lift both for the ops they tag."""
    mark_parameter_aliases: bool = True
    """ZeRO-3: gathered weights (and their views and casts) are never saved for the backward,
    which re-gathers them from the shard. false: they may be saved like activations.

    The code calls this the ZeRO-3 marking: the aliases are marked must-recompute."""
    parameter_indices: Optional[tuple[int, ...]] = None
    """Which inputs of the compiled graph are parameters; null (the usual): found by the
    backend.

    None: taken from the backend (nn.Parameter inputs) or, failing that, AOTAutograd's
    static_lifetime_input_indices. Indices count the joint graph's primals."""
    cast_before_gather: bool = True
    """ZeRO-3: a gather whose full-precision result is only downcast gathers the downcast
    shards instead (half the bytes; no fp32 full weight)."""
    schedule_gathers: bool = True
    """ZeRO-3: place each gather just before its first use, prefetch it (max_prefetch,
    prefetch_budget_bytes), and bucket small gathers (csrc/schedule)."""
    max_prefetch: int = field(default=2, metadata={"min": 0})
    """How many compute steps ahead a gather may be issued."""
    prefetch_budget_bytes: float = -1.0
    """Simulated peak a prefetch may reach; < 0: no budget, every gather max_prefetch steps
    ahead. A budget reads this rank's sizes: where ranks compile a graph at other sizes
    (per-rank padding, before shapes turn dynamic), they run the distances the first of them
    chose (the collectives must meet in order)."""
    bucket_bytes: Union[Auto, int] = field(default="auto", metadata={"min": 0})
    """"auto": one gather and one reduce-scatter per layer, as FSDP2's per-layer units give:
    read from each compiled graph, the gather buckets hold the largest layer's gathered bytes
    and the gradient buckets its gradient bytes (at most 256 MiB each; a graph without
    repeated layers is one unit); the report says what was chosen. A number: gathers of at
    most this many bytes that land at one point share one collective; in the backward,
    gradients of at most this many bytes share reduce-scatters of at most this many bytes in
    all. 0: no buckets.

    zero3/unit_buckets.py reads a layer as the module path up to its first container index
    (`model.layers.3`)."""
    async_gathers: AsyncGathers = "auto"
    """Issue a gather the schedule moved ahead of its use as an async start/wait pair
    (dcr::allgather_cast_start / dcr::allgather_cast_wait, and a bucket's
    dcr::allgather_cast_bucket_start / _wait: the same cast into the slot and in-place gather
    as every other gather, its collective left in flight in between) so communication
    overlaps compute. "auto": only where the collective runs on its own stream (NCCL).
    "on" / "off": always / never. On gloo "auto" is off, by measurement
    (benchmarks/README.md, "Async collectives on gloo"): on the CPU the collective's threads
    share the cores the compute would run on. Over gloo at most one gather is in flight."""
    async_reduce_scatters: AsyncGathers = "auto"
    """Split each gradient reduce-scatter of a backward graph (and each bucket of them) into
    a start, issued as soon as the gradient exists, and a wait placed as late as the memory
    budget (prefetch_budget_bytes) allows, at the latest where the graph returns the
    gradient (zero3/scatter_overlap.py): the collective runs under the rest of the backward,
    holding its send buffer until the wait. "auto": only where the group runs NCCL; off on
    gloo by the measurement given under async_gathers. "on" / "off": always / never."""
    cse: bool = True
    """Run FX common-subexpression elimination on the joint graph before the cut."""
    keep_reports: int = field(default=1000, metadata={"min": 0})
    """How many PartitionReports this process keeps (oldest dropped first)."""
    memory_budget: Optional[float] = field(default=None, metadata={"min": 0})
    """Memory-budget mode (partition/budget.py): None (default) is the ordinary cut. A number
    <= 1 is a fraction of the bytes the ordinary cut saves (1.0: as much as it, 0.5: half),
    raised to the smallest legal cut where it falls below, so 0 means the least memory (as
    torch's activation_memory_budget=0); a number > 1 is bytes per joint graph. The cut then
    recomputes whatever costs the fewest flops while the saved bytes stay within the budget,
    always with the ZeRO-3 marking and the RNG rules. A byte budget below the smallest any
    legal cut reaches raises BudgetInfeasibleError naming that smallest one."""
    peak_target: Optional[float] = field(default=None, metadata={"min": 0})
    """Peak-target mode (planning/peak_target.py): None (default) is off. The simulated peak of
    each compiled graph's forward and backward (its inputs, what it saves, its transients; the
    memory simulator, csrc/memsim, over the final graphs): a number <= 1 is a fraction of the
    ordinary cut's peak, a number > 1 is bytes. The planner picks the plan that recomputes
    the least (re-gathers priced at their bytes) among the ordinary cut and the
    memory-budget hulls with and without keeping gathered weights, whose peak fits with the
    simulator's measured margin (a byte target / 1.3; a fraction's plans / 1.05 of it, the
    ordinary cut meeting 1.0 as it is). A byte target no plan fits raises
    PeakTargetInfeasibleError naming the smallest target one would; a fraction no plan
    reaches takes the lowest-peak plan, with a warning (the report's plan.met is False), as
    memory_budget raises a fraction to the smallest cut. Not with memory_budget."""
    offload_activations: bool = False
    """Activation offload, a third choice beside save and recompute (partition/offload.py):
    saved activations of 1 MiB or more are copied to the host in the forward and back just
    before their first use in the backward, largest first while all the copies cost at most
    the step's flops (so they can run under its compute); the report lists what moved, the
    bytes each way and the simulated peak before and after. Off until measured on a GPU.

    Priced with host_link_flops_per_byte; the memory simulator (and so peak_target) counts
    accelerator bytes only."""
    host_link_flops_per_byte: float = field(default=16000.0, metadata={"min": 0})
    """What one byte over the host link costs in the flops the cut prices recomputation in:
    the accelerator's flop rate over the link's one-way bandwidth (an H100's ~400 TFLOP/s of
    bf16 matmuls over PCIe Gen5's ~25 GB/s: 16000). Read by offload_activations only."""
    backend: Optional[BackendKind] = None
    """The torch.compile backend kind: "inductor" or "eager" (the partitioned FX graphs run
    as they are). null: "inductor" unless the caller picks one (deepcompile_remat.backend(kind),
    or engine.compile(backend=...) on a DeepSpeed engine). Set: what the DeepSpeed takeover
    compiles with; a caller asking for the other kind is refused.

    Refused: backend(kind) raises; engine.compile(backend=...) warns and is not honoured."""
    compile_scope: CompileScope = "auto"
    """What the DeepSpeed takeover (and deepcompile_remat.compile(model)) compiles: "layers":
    each of the model's repeated layers on its own (one compiled graph serves every layer of
    a class), the model around them eager and one unit, gathered in one collective and
    reduce-scattered in one (FSDP2's root);
    "model": the whole forward, one graph. "auto": "layers" where the model has an
    nn.ModuleList of two or more blocks of one class (a transformer's layers), else "model";
    the takeover's INFO line says which.

    zero3/layers.py (zero3.compile_by_layer) says why per-layer is the default: first-step
    compile time that does not grow with depth, and HF checkpointing's causal SDPA kept."""

    def __post_init__(self) -> None:
        hints = _type_hints()
        for f in dataclasses.fields(self):
            value = _checked(f, hints[f.name], getattr(self, f.name))
            object.__setattr__(self, f.name, value)
        if self.memory_budget is not None and self.peak_target is not None:
            raise ValueError(
                f"RematConfig.memory_budget ({self.memory_budget!r}) and "
                f"RematConfig.peak_target ({self.peak_target!r}) are both set: set one. "
                f"peak_target plans against the step's simulated peak; memory_budget bounds "
                f"the bytes the forward saves.")

    @classmethod
    def from_dict(cls, block: Mapping[str, Any], *, where: str = "deepcompile_remat") -> "RematConfig":
        """Builds a config from a JSON block; unknown keys are errors (typos must not pass)."""
        if not isinstance(block, Mapping):
            raise ValueError(f"{where} must be a JSON object, got {type(block).__name__}")
        known = field_names()
        for key in block:
            if key not in known:
                raise ValueError(f"{where}: unknown key {key!r}{_did_you_mean(key, known)}; "
                                 f"valid keys: {sorted(known)}")
        try:
            return cls(**block)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    @property
    def backend_kind(self) -> BackendKind:
        """The backend kind that compiles: `backend`, or DEFAULT_BACKEND when it is None."""
        return self.backend if self.backend is not None else DEFAULT_BACKEND

    @classmethod
    def disabled(cls) -> "RematConfig":
        """The off state: torch's partitioner, nothing of ours."""
        return cls(enabled=False)

    def as_dict(self) -> dict:
        """Every field, JSON-able (what ranks compare: deepspeed/engine.py, zero3.shard)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if out["parameter_indices"] is not None:
            out["parameter_indices"] = list(out["parameter_indices"])
        return out


class PeakTargetInfeasibleError(ValueError):
    """Raised when no plan's simulated peak fits RematConfig.peak_target with the simulator's
    margin (planning/peak_target.py); `.min_bytes` holds the smallest target a plan would fit
    (the lowest simulated peak with the margin), which the message names too.
    Defined here, beside the setting, so that importing it needs no torch. A subclass of
    ValueError."""

    def __init__(self, message: str, min_bytes: float) -> None:
        super().__init__(message)
        self.min_bytes = min_bytes


def field_names() -> frozenset:
    """The keys RematConfig (and so the ds_config block) takes."""
    return frozenset(f.name for f in dataclasses.fields(RematConfig))


def _did_you_mean(key: Any, known) -> str:
    """' (did you mean 'x'?)' for the valid key closest to a misspelt one, else ''."""
    if not isinstance(key, str):
        return ""
    close = difflib.get_close_matches(key.lower(), sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


_HINTS: dict = {}


def _type_hints() -> dict:
    if not _HINTS:
        _HINTS.update(typing.get_type_hints(RematConfig))
    return _HINTS


def _optional_of(hint):
    """X for Optional[X] (a Union of X and None), else None."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0]
    return None


def _choice_or_int(hint):
    """The Literal's choices for Union[Literal[...], int], else None."""
    if typing.get_origin(hint) not in (Union, types.UnionType):
        return None
    args = typing.get_args(hint)
    literals = [a for a in args if typing.get_origin(a) is Literal]
    if len(args) == 2 and len(literals) == 1 and int in args:
        return typing.get_args(literals[0])
    return None


def _check_min(f: dataclasses.Field, name: str, value) -> None:
    """The field's metadata "min", if it has one, bounds `value` from below."""
    if value < f.metadata.get("min", -math.inf):
        raise ValueError(f"{name} must be >= {f.metadata['min']}, got {value!r}")


def _checked(f: dataclasses.Field, hint, value):
    """value, validated against the field's type (and its metadata's "min"); normalised where
    JSON cannot say it (a list of indices becomes a tuple). The one validator of every field:
    a bool is never taken for a number, nor a number for a bool."""
    name = f"RematConfig.{f.name}"
    inner = _optional_of(hint)
    if inner is not None:
        if value is None:
            return None
        hint = inner
    choices = _choice_or_int(hint)
    if choices is not None:  # Union[Literal[...], int]: one of the words, or an integer
        if isinstance(value, str) and value in choices:
            return value
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be one of {list(choices)} or an integer, "
                             f"got {value!r}")
        _check_min(f, name, value)
        return value
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        if value not in choices or isinstance(value, bool):
            none = " or null" if inner is not None else ""
            raise ValueError(f"{name} must be one of {list(choices)}{none}, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        _check_min(f, name, value)
        return value
    if hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        _check_min(f, name, value)
        return float(value)
    if typing.get_origin(hint) is tuple and typing.get_args(hint) == (int, ...):
        if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
            raise ValueError(f"{name} must be a list of non-negative integers, got {value!r}")
        indices = tuple(value)
        for i, v in enumerate(indices):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}[{i}] must be a non-negative integer, got {v!r}")
        return indices
    raise TypeError(f"{name}: no validator for type {hint!r}")  # a field added without one


def check_ranks_agree(settings: dict, where: str, group=None) -> None:
    """Every rank of `group` (default: the world) must hold the same settings; raises on every
    rank, naming the first differing key (in the settings' order) and which ranks hold which
    value. A no-op without a process group of several ranks."""
    import torch.distributed as dist  # here, so reading a config needs no torch

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) < 2:
        return
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, settings, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(everyone))
    for key in dict.fromkeys(k for theirs in everyone for k in theirs):
        values: dict = {}
        for rank, theirs in zip(ranks, everyone):
            values.setdefault(repr(theirs.get(key, "<absent>")), []).append(rank)
        if len(values) > 1:
            held = "; ".join(f"{v} on rank{'s' if len(r) > 1 else ''} "
                             f"{', '.join(map(str, r))}" for v, r in values.items())
            raise ValueError(
                f"{where}: ranks disagree on {key}: {held}. Every rank must use the same "
                f"config, or the ranks build different engines and hang in their first "
                f"mismatched collective.")
