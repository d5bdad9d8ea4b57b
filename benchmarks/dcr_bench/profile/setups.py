"""The experiment matrix: backend x precision x setup, each setup a RematConfig.

Every setup but `unbucketed` issues its collectives the same way, so that a column measures
what it names and not bucketing: gathers that land at one point, and small ones, share a
collective, and small gradients share reduce-scatters, by one fixed bucket_bytes,
PROFILE_BUCKET_BYTES (64 KB, the default before "auto"; the runtime's own passes:
zero3/schedule.py, zero3/grad_buckets.py). Fixed, so every row, and every earlier run, cuts
under the same buckets; `compare` and `frontier` measure the defaults ("auto").

setups
  unbucketed  torch's partitioner (min_cut_rematerialization_partition; stock inductor) and
              nothing of ours: one gather and one reduce-scatter per parameter. Only there to
              show what the buckets alone are worth (unbucketed vs baseline)
  baseline    torch's partitioner, with the runtime's collective buckets on its forward and
              backward graphs: gathered weights look like activations and are saved for the
              backward
  regather    our min-cut, never saving a gathered weight (mark_parameter_aliases, "the ZeRO-3
              marking" in the code; the setup of DeepSpeed PR #7609): gathered, viewed and cast
              weights are never saved, the backward gathers them again; fp32 gather then cast;
              the same buckets, no prefetch
  ours        regather + cast-before-gather (half the bytes on the wire, no fp32 full weight) +
              prefetch (each re-gather issued up to max_prefetch ops before its first use,
              within the memory budget); RematConfig's defaults but the buckets
  ours@B      ours in memory-budget mode, RematConfig(memory_budget=B) (`profile --budgets`):
              B <= 1 a fraction of the bytes the ordinary cut saves, > 1 bytes per graph; the
              cut then recomputes the fewest flops that keep the saved bytes within B
The buckets come with the re-gather schedule: baseline and regather run it at prefetch
distance 0, which keeps each gather just before its first use, where the traced forward and
the backward's extraction (torch's reordering_to_mimic_autograd_engine) already place it.
precisions
  autocast  fp32 parameters (shards), bf16 compute under torch.autocast
  bf16      bf16 parameters: no cast, so regather and ours differ by the prefetch only
backends
  config.BACKEND_KINDS: eager (AOTAutograd, the partitioned FX graphs run as they are) and
  inductor (torch.compile's default compiler)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

from deepcompile_remat.config import BACKEND_KINDS, RematConfig

SETUPS = ("unbucketed", "baseline", "regather", "ours")
PRECISIONS = ("autocast", "bf16")

# What each setup is, in plain words (the table's legend, the timeline's legend).
SETUP_HELP = {
    "unbucketed": "torch's partitioner alone: it saves gathered weights for the backward; one "
                  "collective per parameter",
    "baseline": "torch's partitioner with our collective buckets: it saves gathered weights "
                "for the backward",
    "regather": "our min-cut: gathered weights never saved, the backward gathers them again "
                "(fp32 gather, then cast; DeepSpeed PR #7609's setup); same buckets",
    "ours": "regather + cast to bf16 before the gather (half the bytes, no fp32 full weight) "
            "+ prefetch; same buckets",
}
PRECISION_HELP = {
    "autocast": "fp32 parameters, bf16 compute under torch.autocast",
    "bf16": "bf16 parameters (nothing to cast: regather and ours differ by the prefetch only)",
}

BUDGET_SETUP = "ours"  # the setup --budgets runs in budget mode
BUDGET_HELP = ("ours with RematConfig(memory_budget=B): B <= 1 a fraction of the bytes the "
               "ordinary cut saves (0: the smallest legal cut), > 1 bytes per graph")


def budget_label(budget: float) -> str:
    """The setup name of a budget cell, "ours@B", B as the user wrote it (1, 0.5, 2e+08)."""
    return f"{BUDGET_SETUP}@{budget:g}"


def is_budget_label(setup: str) -> bool:
    """True for the setup names budget cells get (budget_label)."""
    return setup.startswith(BUDGET_SETUP + "@")


PROFILE_BUCKET_BYTES = 1 << 16  # every setup's buckets (module docstring)
# Buckets without prefetch: the re-gather schedule at distance 0 (see the module docstring).
_BUCKETS_NO_PREFETCH = {"cast_before_gather": False, "max_prefetch": 0,
                        "bucket_bytes": PROFILE_BUCKET_BYTES}


def remat_config(setup: str) -> RematConfig:
    """The RematConfig a setup compiles with (baseline's buckets: see bucketed_partitions)."""
    if setup in ("unbucketed", "baseline"):
        return RematConfig(enabled=False)
    if setup == "regather":
        return RematConfig(**_BUCKETS_NO_PREFETCH)
    if setup == "ours":
        return RematConfig(bucket_bytes=PROFILE_BUCKET_BYTES)
    raise ValueError(f"setup must be one of {SETUPS}, got {setup!r}")


def bucketed_partitions(observer: Optional[Callable] = None) -> Callable:
    """An on_partition for torch's partitioner: gives each (fw, bw) pair the runtime's collective
    buckets, as regather has them (Zero3Runtime.rewrite at prefetch distance 0), then shows
    it to `observer`. backends.backend calls on_partition after the partitioner returns and
    before either graph is compiled, so what is compiled is the bucketed pair."""
    from dcr_bench.profile.partitions import parameter_names
    from deepcompile_remat.zero3.runtime import Zero3Runtime
    from deepcompile_remat.zero3.topology import topology_of
    from deepcompile_remat.zero3.unit_buckets import resolve_auto

    config = RematConfig(**_BUCKETS_NO_PREFETCH)

    def on_partition(fw, bw, example_inputs) -> None:
        runtime = Zero3Runtime(config, topology_of(fw))
        settings, _ = resolve_auto(runtime.settings, fw, bw)  # the buckets ours reads
        runtime.rewrite(fw, bw, parameter_names(fw, example_inputs), settings)
        if observer is not None:
            observer(fw, bw, example_inputs)

    return on_partition


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix: which backend compiles, in which precision, with which setup;
    budget (ours only): run ours in memory-budget mode with RematConfig(memory_budget=budget)."""

    backend: str
    precision: str
    setup: str
    budget: Optional[float] = None

    def __post_init__(self) -> None:
        for value, allowed, what in ((self.backend, BACKEND_KINDS, "backend"),
                                     (self.precision, PRECISIONS, "precision"),
                                     (self.setup, SETUPS, "setup")):
            if value not in allowed:
                raise ValueError(f"{what} must be one of {allowed}, got {value!r}")
        if self.budget is not None:
            if self.setup != BUDGET_SETUP:
                raise ValueError(f"a budget runs the {BUDGET_SETUP!r} setup, not {self.setup!r}")
            self.config()  # RematConfig validates memory_budget (a finite number >= 0)

    @property
    def label(self) -> str:
        """The setup as rows and tables name it: the setup, or "ours@B" for a budget cell."""
        return self.setup if self.budget is None else budget_label(self.budget)

    @property
    def name(self) -> str:
        """backend/precision/label, as the progress line and the tables print it."""
        return f"{self.backend}/{self.precision}/{self.label}"

    def config(self) -> RematConfig:
        """The setup's RematConfig (with memory_budget for a budget cell)."""
        config = remat_config(self.setup)
        if self.budget is None:
            return config
        return dataclasses.replace(config, memory_budget=self.budget)

    def compile_backend(self, on_partition=None):
        """The product's own torch.compile backend for this cell; on_partition(fw, bw,
        example_inputs) sees each partition as it will be compiled (baseline's buckets in)."""
        from deepcompile_remat.backends import backend

        if self.setup == "baseline":
            on_partition = bucketed_partitions(on_partition)
        return backend(self.backend, self.config(), on_partition=on_partition)


def matrix(backends: Iterable[str] = BACKEND_KINDS, precisions: Iterable[str] = PRECISIONS,
           setups: Iterable[str] = SETUPS, budgets: Sequence[float] = ()) -> list[Cell]:
    """Cells in the order they run: per backend and precision, the setups side by side, then
    one "ours@B" cell per budget, in the order given."""
    setups, budgets = list(setups), list(dict.fromkeys(budgets))  # a repeat would share a row
    return [cell for b in backends for p in precisions
            for cell in ([Cell(b, p, s) for s in setups]
                         + [Cell(b, p, BUDGET_SETUP, budget=x) for x in budgets])]
