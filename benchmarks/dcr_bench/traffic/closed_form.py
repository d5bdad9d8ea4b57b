"""The same figures from the parameter counts alone, as formulas.

Notation: W ranks in N nodes of G (W = N G). For parameter i: n_i elements, g_i bytes per
gathered element (4 in fp32; 2 when shard(param_dtype=bf16) gathers it cast), r_i bytes per
gradient element (the shard's dtype: 4; gradients are reduced in fp32, FSDP2's
reduce_dtype=float32). P_k(n) = ceil(n / k) k is n padded to k equal shards (zero3.shard's
padding). Per step:

    F_k = sum_i P_k(n_i) g_i               forward gathers: every weight, once
    B_k = sum_{i re-gathered} P_k(n_i) g_i  backward re-gathers: every weight whose gradient
                                            reads it; an embedding table's does not (its
                                            gradient is the output gradient scattered by token
                                            id), so the runtime never re-gathers it
    R_k = sum_i P_k(n_i) r_i               gradient reduce-scatters (full gradients)
    A_k = sum_i P_k(n_i) r_i / k           hybrid sharding's all-reduce of each gradient shard

A ring collective over k ranks sends (k-1)/k of its buffer from every rank (an all-reduce
twice that). A ring over all W ranks, numbered node by node, leaves each node once; a ring
within a node never leaves it; a ring over one rank per node leaves its node at every hop.
So, per rank sent, and bytes leaving each node (per rank: divide by G):

    zero3  sent (W-1)/W (F_W + B_W + R_W)        leaving a node (W-1)/W (F_W + B_W + R_W)
    hpz    sent (W-1)/W (F_W + R_W)              leaving a node (W-1)/W (F_W + R_W)
              + (G-1)/G B_W                         (re-gathers stay in the node)
    hsdp   sent (G-1)/G (F_G + B_G + R_G)        leaving a node G 2 (N-1)/N A_G = 2 (N-1)/N R_G
              + 2 (N-1)/N A_G

(with N = 1, nothing leaves). The ZeRO++ paper (Wang et al., 2023, sec. 3) counts the same way
in units of the model's 16-bit size M: ZeRO-3 moves 3M per step across the slow links
(forward all-gather M, backward all-gather M, reduce-scatter M); hpZ removes the backward's,
2M; its 0.75M adds int8 weights (qwZ, M -> 0.5M) and int4 gradients (qgZ, M -> 0.25M),
which this runtime does not do. Here, with 16-bit gathers and fp32 gradients, F = M,
B = M - E (E: embedding tables) and R = 2M; with fp32 gathers F = 2M, B = 2(M - E).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn as nn

from dcr_bench.traffic.ring import GROUPS, PhaseTraffic, Ranks


@dataclasses.dataclass(frozen=True)
class ParameterFacts:
    """What the formulas need of one (untied) parameter."""
    numel: int
    gather_bytes: int  # per element, as gathered (param_dtype's where it casts)
    grad_bytes: int  # per element, as reduced (the shard's dtype)
    regathered: bool  # its gradient reads it (not only an embedding table)


def parameter_facts(model: nn.Module, param_dtype: Optional[torch.dtype] = None
                    ) -> list[ParameterFacts]:
    """The facts of every parameter of `model` (tied ones once); param_dtype as
    zero3.shard's."""
    owners: dict[int, list[nn.Module]] = {}
    params: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(module)
                params[id(p)] = p
    facts = []
    for key, p in params.items():
        cast = param_dtype is not None and p.is_floating_point() and p.dtype != param_dtype
        gather = torch.empty((), dtype=param_dtype if cast else p.dtype).element_size()
        facts.append(ParameterFacts(p.numel(), gather, p.element_size(),
                                    not all(isinstance(m, nn.Embedding) for m in owners[key])))
    return facts


def _padded(n: int, k: int) -> int:
    return -(-n // k) * k


def phase_bytes(facts: list[ParameterFacts], k: int) -> dict[str, int]:
    """F_k, B_k, R_k and A_k of the module docstring, by phase name."""
    return {
        "forward gathers": sum(_padded(f.numel, k) * f.gather_bytes for f in facts),
        "backward re-gathers": sum(_padded(f.numel, k) * f.gather_bytes
                                   for f in facts if f.regathered),
        "gradient reduce-scatters": sum(_padded(f.numel, k) * f.grad_bytes for f in facts),
        "replica all-reduces": sum(_padded(f.numel, k) * f.grad_bytes // k for f in facts),
    }


def closed_form(layout: str, facts: list[ParameterFacts], ranks: Ranks) -> list[PhaseTraffic]:
    """The module docstring's formulas for `layout`, one PhaseTraffic per phase (collective
    counts are not part of the formulas: 0). The rank that sends the most across a boundary
    is one whose ring successor is on another node: all it sends."""
    w, g, n = ranks.world, ranks.node_size, ranks.nodes
    flat = phase_bytes(facts, w)
    node = phase_bytes(facts, g)
    out = []
    for phase, kind in GROUPS[layout].items():
        if layout == "hsdp":
            buffer = node[phase]
        else:
            buffer = flat[phase]
        if phase == "replica all-reduces":
            sent = 2 * (n - 1) / n * buffer
            leaving = g * sent
        elif kind == "world":
            sent = (w - 1) / w * buffer
            leaving = sent if n > 1 else 0.0
        else:  # within a node
            sent = (g - 1) / g * buffer
            leaving = 0.0
        size = {"world": w, "node": g, "replica": n}[kind]
        out.append(PhaseTraffic(layout, phase, kind, size, 0, sent, leaving / g,
                                sent if leaving else 0.0, leaving))
    return out


def model_bytes_16bit(facts: list[ParameterFacts]) -> int:
    """M, the ZeRO++ paper's unit: the model's size in 16-bit elements (unpadded)."""
    return 2 * sum(f.numel for f in facts)
