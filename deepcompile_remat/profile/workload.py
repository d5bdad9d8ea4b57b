"""What a measurement trains: the model (the built-in GPT or a transformers model), its repeated
blocks, one micro-batch per rank and the loss.

    w = Workload(model="llama", layers=4, hidden=256, ...)        # or model="gpt", a config.json
    model = w.build(precision)     # same weights on every rank and for every system measured
    loss = w.loss(run, model_inputs)

transformers models are built from a preset or a config.json with random weights (never a
download; bench/hf_models.py), dropout off so every system draws the same numbers, and with
HF's activation checkpointing when asked. The blocks are the model's repeated layers (what
FSDP2 wraps one by one, and what torch.compile compiles per block).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn as nn


# The defaults (every command's): weights dominate (hidden 512 at 16 tokens) and the bf16 GEMMs
# a CPU emulates stay small; two layers keep inductor's compile, most of a profile run, inside 3
# minutes on 2 cores even with a cold kernel cache.
@dataclass(frozen=True)
class Workload:
    model: str = "gpt"  # "gpt", a transformers preset (llama, qwen2, gpt2), or a config.json
    layers: int = 2
    hidden: int = 512
    heads: int = 8
    vocab: int = 512
    seq: int = 16
    batch: int = 1
    checkpointing: bool = False

    @property
    def is_hf(self) -> bool:
        return self.model != "gpt"

    def build(self, precision: str, device="cpu") -> nn.Module:
        """Fresh model, the same weights every call (seeded), in bf16 for precision "bf16"."""
        torch.manual_seed(0)
        with torch.device(device):
            if self.is_hf:
                from deepcompile_remat.bench import hf_models

                model = hf_models.build(self.model, vocab=self.vocab, hidden=self.hidden,
                                        layers=self.layers, heads=self.heads,
                                        kv_heads=self.heads, seq=max(self.seq, 64), dropout=0.0)
                if self.checkpointing:
                    hf_models.enable_checkpointing(model, use_reentrant=False)
            else:
                if self.checkpointing:
                    raise ValueError("activation checkpointing needs a transformers model "
                                     "(--model llama|qwen2|gpt2|config.json)")
                from deepcompile_remat.bench.models import GPT

                model = GPT(vocab=self.vocab, d=self.hidden, layers=self.layers,
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


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model flags of every command that measures a Workload (defaults: Workload's)."""
    g = parser.add_argument_group("model")
    g.add_argument("--model", default=Workload.model,
                   help='"gpt" (built-in), a transformers preset (llama, qwen2, gpt2) or the path '
                        "of a transformers config.json (random weights)")
    g.add_argument("--checkpointing", action="store_true",
                   help="HF's activation checkpointing on every layer (transformers models)")
    for name in SIZES:
        g.add_argument(f"--{name}", type=int, default=getattr(Workload, name))


def workload_from_args(args: argparse.Namespace, command: str) -> Workload:
    """The Workload the model flags describe; a bad size is an error naming the flag."""
    for name in SIZES:
        if getattr(args, name) < 1:
            raise SystemExit(f"deepcompile-remat {command}: --{name} must be >= 1")
    if args.hidden % args.heads:
        raise SystemExit(f"deepcompile-remat {command}: --hidden must be a multiple of --heads")
    return Workload(model=args.model, checkpointing=args.checkpointing,
                    **{name: getattr(args, name) for name in SIZES})

