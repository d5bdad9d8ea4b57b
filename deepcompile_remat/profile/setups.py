"""The experiment matrix: backend x precision x setup, each setup a RematConfig.

setups
  baseline  torch's partitioner (min_cut_rematerialization_partition; stock inductor), nothing
            of ours: gathered weights look like activations and are saved for the backward
  marking   our min-cut with the ZeRO-3 marking: gathered, viewed and cast weights are never
            saved, the backward re-gathers them; fp32 gather then cast, no schedule (the setup
            of DeepSpeed PR #7609)
  ours      marking + cast-before-gather (half the bytes on the wire, no fp32 full weight) +
            the scheduled re-gather (each just before its first use, prefetch within budget)
precisions
  autocast  fp32 parameters (shards), bf16 compute under torch.autocast
  bf16      bf16 parameters: no cast, so marking and ours differ by the schedule only
backends
  eager     AOTAutograd, the partitioned FX graphs run as they are
  inductor  torch.compile's default compiler
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from deepcompile_remat.config import RematConfig

SETUPS = ("baseline", "marking", "ours")
PRECISIONS = ("autocast", "bf16")
BACKENDS = ("eager", "inductor")

SETUP_HELP = {
    "baseline": "torch's partitioner, no marking",
    "marking": "min-cut + marking, fp32 gather then cast (PR #7609)",
    "ours": "marking + cast-before-gather + scheduled re-gather",
}
PRECISION_HELP = {
    "autocast": "fp32 params, bf16 compute (autocast)",
    "bf16": "bf16 params (no cast: marking vs ours = schedule only)",
}


def remat_config(setup: str) -> RematConfig:
    if setup == "baseline":
        return RematConfig(enabled=False)
    if setup == "marking":
        return RematConfig(cast_before_gather=False, schedule_gathers=False)
    if setup == "ours":
        return RematConfig()
    raise ValueError(f"setup must be one of {SETUPS}, got {setup!r}")


@dataclass(frozen=True)
class Cell:
    backend: str
    precision: str
    setup: str

    def __post_init__(self) -> None:
        for value, allowed, what in ((self.backend, BACKENDS, "backend"),
                                     (self.precision, PRECISIONS, "precision"),
                                     (self.setup, SETUPS, "setup")):
            if value not in allowed:
                raise ValueError(f"{what} must be one of {allowed}, got {value!r}")

    @property
    def name(self) -> str:
        return f"{self.backend}/{self.precision}/{self.setup}"

    def config(self) -> RematConfig:
        return remat_config(self.setup)

    def compile_backend(self, on_partition=None):
        """The product's own torch.compile backend for this cell."""
        from deepcompile_remat.backends import backend

        return backend(self.backend, self.config(), on_partition=on_partition)


def matrix(backends: Iterable[str] = BACKENDS, precisions: Iterable[str] = PRECISIONS,
           setups: Iterable[str] = SETUPS) -> list[Cell]:
    """Cells in the order they run: per backend and precision, the setups side by side."""
    return [Cell(b, p, s) for b in backends for p in precisions for s in setups]
