"""What a measurement trains: the model (the built-in GPT or a transformers model), its repeated
blocks, one micro-batch per rank and the loss.

    w = Workload(model="llama", layers=4, hidden=256, ...)        # or model="gpt", a config.json
    model = w.build(precision)     # same weights on every rank and for every system measured
    loss = w.loss(run, model_inputs)

transformers models are built from a preset or a config.json with random weights (never a
download; harness/models.py), dropout off so every system draws the same numbers, and with
HF's activation checkpointing when asked. A config.json's layers, hidden, heads and vocab are
its own (workload_from_args reads them; the flags size the presets and the built-in GPT).
The blocks are the model's repeated layers (what FSDP2 wraps one by one, and what
torch.compile compiles per block).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn as nn

from dcr_bench.harness import models


# The defaults (every command's): weights dominate (hidden 512 at 16 tokens) and the bf16 GEMMs
# a CPU emulates stay small; two layers keep inductor's compile, most of a profile run, inside 3
# minutes on 2 cores even with a cold kernel cache.
@dataclass(frozen=True)
class Workload:
    """One measurement's model and micro-batch: built the same on every rank and for every
    system measured (see the module docstring)."""

    model: str = "gpt"  # "gpt", a transformers preset (llama, qwen2, gpt2), or a config.json
    # (whose layers, hidden, heads and vocab these must be: workload_from_args reads them)
    layers: int = 2
    hidden: int = 512
    heads: int = 8
    vocab: int = 512
    seq: int = 16
    batch: int = 1
    checkpointing: bool = False

    @property
    def is_hf(self) -> bool:
        """True for a transformers model (a named architecture or a config.json), False for the
        built-in GPT."""
        return self.model != "gpt"

    def build(self, precision: str, device="cpu") -> nn.Module:
        """Fresh model, the same weights every call (seeded), in bf16 for precision "bf16"."""
        torch.manual_seed(0)
        with torch.device(device):
            if self.is_hf:
                model = models.build_hf(self.model, vocab=self.vocab, hidden=self.hidden,
                                        layers=self.layers, heads=self.heads,
                                        kv_heads=self.heads, seq=max(self.seq, 64), dropout=0.0)
                if models.is_hf_config_path(self.model):
                    own = models.hf_sizes(model.config)
                    if any(own[k] != getattr(self, k) for k in SHAPE):
                        raise ValueError(
                            f"{self.model} has {({k: own[k] for k in SHAPE})}, this Workload "
                            f"{({k: getattr(self, k) for k in SHAPE})}: take the sizes from "
                            "the config (workload_from_args does)")
                if self.checkpointing:
                    models.enable_hf_checkpointing(model, use_reentrant=False)
            else:
                if self.checkpointing:
                    raise ValueError("activation checkpointing needs a transformers model "
                                     "(--model llama|qwen2|gpt2|config.json)")
                model = models.GPT(vocab=self.vocab, d=self.hidden, layers=self.layers,
                            heads=self.heads, max_t=self.seq)
        return model.to(torch.bfloat16) if precision == "bf16" else model

    def inputs(self, rank: int, device="cpu") -> dict:
        """This rank's micro-batch: token ids (and, for the built-in GPT, separate targets)."""
        g = torch.Generator().manual_seed(1000 + rank)
        idx = torch.randint(0, self.vocab, (self.batch, self.seq), generator=g)
        targets = torch.randint(0, self.vocab, (self.batch, self.seq), generator=g)
        return {"idx": idx.to(device), "targets": targets.to(device)}

    def loss(self, run, batch: dict) -> torch.Tensor:
        """The fp32 loss of `run` (the model, compiled or wrapped) on a micro-batch."""
        if self.is_hf:
            return run(input_ids=batch["idx"], labels=batch["idx"]).loss.float()
        logits = run(batch["idx"])
        return nn.functional.cross_entropy(logits.float().view(-1, self.vocab),
                                           batch["targets"].view(-1))

    def describe(self, parameters: int) -> str:
        """One line for a table's title: the model, its sizes and `parameters`."""
        name = "GPT" if not self.is_hf else self.model
        ckpt = ", activation checkpointing" if self.checkpointing else ""
        return (f"{name} {self.layers} layers, hidden {self.hidden}, {self.heads} heads, vocab "
                f"{self.vocab}, batch {self.batch} x seq {self.seq}{ckpt}: "
                f"{parameters / 1e6:.1f} M parameters")


def blocks(model: nn.Module) -> list:
    """The model's repeated layers: the longest nn.ModuleList in it."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of layers")
    return list(max(lists, key=len))


def leaf_modules(model: nn.Module) -> list:
    """The modules that hold parameters directly (Linear, LayerNorm, RMSNorm, Embedding, ...):
    FSDP2's finest wrapping."""
    return [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))
            and m is not model]


SIZES = ("layers", "hidden", "heads", "vocab", "seq", "batch")
SHAPE = ("layers", "hidden", "heads", "vocab")  # what a config.json sets itself


def add_model_arguments(parser: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """The model flags of every command that measures a Workload (defaults: Workload's, or
    `defaults`). The shape flags default to None, so a config.json's own sizes can be told from
    a flag given by hand (workload_from_args)."""
    defaults = {**_defaults(), **(defaults or {})}
    g = parser.add_argument_group("model")
    g.add_argument("--model", default=Workload.model,
                   help='"gpt" (built-in), a transformers preset (llama, qwen2, gpt2) or the path '
                        "of a transformers config.json (random weights; its own layers, hidden, "
                        "heads and vocab)")
    g.add_argument("--checkpointing", action="store_true",
                   help="HF's activation checkpointing on every layer (transformers models)")
    for name in SIZES:
        g.add_argument(f"--{name}", type=int, default=None if name in SHAPE else defaults[name],
                       help=f"default {defaults[name]}"
                            + ("; a config.json's own" if name in SHAPE else ""))


def _defaults() -> dict:
    return {name: getattr(Workload, name) for name in SIZES}


def workload_from_args(args: argparse.Namespace, command: str,
                       defaults: dict | None = None) -> Workload:
    """The Workload the model flags describe; a bad size is an error naming the flag. A
    config.json sets layers, hidden, heads and vocab itself: a shape flag that says otherwise,
    a --seq past its max_position_embeddings, or a file that is no config, is an error naming
    the file."""
    defaults = {**_defaults(), **(defaults or {})}
    given = {name: getattr(args, name) for name in SIZES if getattr(args, name) is not None}
    for name, value in given.items():
        if value < 1:
            raise SystemExit(f"deepcompile-remat {command}: --{name} must be >= 1")
    sizes = {**defaults, **given}
    if models.is_hf_config_path(args.model):
        try:
            own = models.hf_sizes(models.hf_config(args.model))
        except (ValueError, TypeError, KeyError) as e:
            raise SystemExit(f"deepcompile-remat {command}: --model {e}") from None
        max_seq = own.pop("max_seq")
        for name, value in own.items():
            if given.get(name, value) != value:
                raise SystemExit(
                    f"deepcompile-remat {command}: --{name} {given[name]}, but {args.model} "
                    f"has {name} {value} (a config.json's shape is its own: leave "
                    f"--{name} out)")
        if isinstance(max_seq, int) and sizes["seq"] > max_seq:
            raise SystemExit(f"deepcompile-remat {command}: --seq {sizes['seq']} is past "
                             f"{args.model}'s max_position_embeddings {max_seq}")
        sizes.update(own)
    if sizes["hidden"] % sizes["heads"]:
        raise SystemExit(f"deepcompile-remat {command}: --hidden must be a multiple of --heads")
    return Workload(model=args.model, checkpointing=args.checkpointing, **sizes)
