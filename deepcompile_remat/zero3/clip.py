"""clip_grad_norm_ over sharded parameters: the norm of the whole model's gradient.

torch.nn.utils.clip_grad_norm_ on a sharded model clips each rank's slice by that slice's own
norm: every rank scales by a different factor and the update is no longer the clipped
gradient. Here each rank sums |g|^p over its gradient shards, the sums are all-reduced over
the shard group (max for the inf-norm), and every rank scales by the same factor: the result
equals clip_grad_norm_ on the unsharded model. Parameters that are not shards (replicated on
every rank) count once. Shard padding holds zero gradient, so it adds nothing.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn


def _is_shard(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_shape")


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clips the gradients of `model`'s parameters in place so that their global norm is at
    most max_norm; returns that global norm (before clipping), the same on every rank. Every
    rank of the shard group must call it."""
    from deepcompile_remat.zero3.shard import _group_of

    norm_type = float(norm_type)
    params = [p for p in model.parameters() if p.grad is not None]
    sharded = [p.grad.detach() for p in params if _is_shard(p)]
    replicated = [p.grad.detach() for p in params if not _is_shard(p)]
    device = params[0].grad.device if params else torch.device("cpu")
    group = _group_of(model) if any(_is_shard(p) for p in model.parameters()) else None

    def local(grads, reduce_max: bool) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=device)
        if reduce_max:
            return torch.stack([g.abs().max().double() for g in grads]).max()
        return sum(torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) ** norm_type
                   for g in grads)

    inf = math.isinf(norm_type)
    total = local(sharded, inf)
    if group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    if inf:
        total = torch.maximum(total, local(replicated, True))
    else:
        total = (total + local(replicated, False)) ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"deepcompile_remat.zero3.clip_grad_norm_: the total norm of order {norm_type} of "
            f"the gradients is non-finite ({total.item()})")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total.float()
