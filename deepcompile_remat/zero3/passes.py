"""Graph passes over AOTAutograd joint graphs for the ZeRO-3 runtime.

cast_before_gather: ``allgather_cast(shard) -> views -> cast(bf16)``, where the full-precision
gathered value and every view in between have no other user, becomes
``allgather_cast(shard, dtype=bf16) -> views``: each rank casts its shard into its slot and
only half the bytes cross the wire; no fp32 full weight is ever built. The pass runs on the
joint graph before the cut, so the backward's re-gathers (recomputed copies of the forward's)
are cast-before-gather too.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from deepcompile_remat.fx_values import OPS, is_view

aten, prims = torch.ops.aten, torch.ops.prims
LOW_PRECISION = (torch.bfloat16, torch.float16)


def is_allgather_cast(node: fx.Node) -> bool:
    """True for a dcr::allgather_cast call in an FX graph."""
    return node.op == "call_function" and node.target is OPS.allgather_cast.default


def gather_dtype(node: fx.Node):
    """The dtype argument of a dcr::allgather_cast node, positional or keyword; None: no cast."""
    args = list(node.args) + [None] * (4 - len(node.args))
    return node.kwargs.get("dtype", args[3])


def _cast_target_dtype(node: fx.Node):
    """The dtype a pure dtype conversion produces, or None if `node` is not one."""
    if node.op != "call_function":
        return None
    if node.target is prims.convert_element_type.default:
        return node.args[1]
    if node.target is aten._to_copy.default:
        extra = set(node.kwargs) - {"dtype", "layout", "device"}
        val, src = node.meta.get("val"), node.args[0].meta.get("val")
        if extra or not isinstance(val, torch.Tensor) or not isinstance(src, torch.Tensor):
            return None
        if val.device != src.device or val.layout != src.layout:
            return None
        return node.kwargs.get("dtype")
    return None


def _refresh_meta(node: fx.Node) -> None:
    """Recomputes meta['val'] of a view node on fake tensors after its input changed dtype."""
    from torch._guards import detect_fake_mode

    vals = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    fake_mode = detect_fake_mode(vals[0])
    with fake_mode:
        node.meta["val"] = node.target(*vals[0], **vals[1])


def cast_before_gather(gm: fx.GraphModule) -> int:
    """Rewrites the graph in place; returns how many gathers now cast before gathering."""
    rewritten = 0
    for gather in list(gm.graph.nodes):
        if not is_allgather_cast(gather) or gather_dtype(gather) is not None:
            continue
        if gather.args[0].meta["val"].dtype != torch.float32:
            continue  # the fused cast is fp32 -> bf16/fp16 only (a bf16 shard stays as it is)
        chain, cur, cast = [], gather, None
        while len(cur.users) == 1:
            (user,) = cur.users
            if is_view(user) and user.args[0] is cur:
                chain.append(user)
                cur = user
                continue
            if _cast_target_dtype(user) in LOW_PRECISION and user.args[0] is cur:
                cast = user
            break
        if cast is None:
            continue
        dtype = _cast_target_dtype(cast)
        shard, world_size, group_name = gather.args[:3]
        gather.args, gather.kwargs = (shard, world_size, group_name), {"dtype": dtype}
        old = gather.meta["val"]
        gather.meta["val"] = old.new_empty(old.shape, dtype=dtype)
        for node in chain:
            _refresh_meta(node)
        cast.replace_all_uses_with(cur)
        gm.graph.erase_node(cast)
        rewritten += 1
    if rewritten:
        gm.graph.lint()
    return rewritten
