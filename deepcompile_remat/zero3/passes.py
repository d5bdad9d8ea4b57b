"""Graph passes over AOTAutograd joint graphs for the ZeRO-3 runtime.

cast_before_gather: ``allgather_cast(shard) -> views -> cast(bf16)``, where the full-precision
gathered value and every view in between have no other user, becomes
``allgather_cast(shard, dtype=bf16) -> views``: each rank casts its shard into its slot and
only half the bytes cross the wire; no fp32 full weight is ever built. The pass runs on the
joint graph before the cut, so the backward's re-gathers (recomputed copies of the forward's)
are cast-before-gather too.

narrow_host_copies (after cast_before_gather): a shard that lives on the host (DeepSpeed's
offload_param under the takeover) reaches its gather through a copy to the accelerator; where
every reader of that copy is a gather that casts to bf16/fp16, the copy becomes ``cast on the
host -> copy -> widen on the accelerator``: half the bytes cross the host link, and the gather
reads the same values (the widening is exact, the gather's cast rounds as before), while the
gradient's path through the copy, and so its precision, stay as they were.

fold_reduce_casts (backward graph, after the cut): ``cast(grad, fp32) -> reduce_scatter_grad``,
where the cast has no other reader, becomes ``reduce_scatter_grad(grad, dtype=fp32)``: the op
casts into its send buffer (a bucket as it packs its rows), so a bucket's members wait in their
16-bit dtype, and the compiler builds no kernel for the casts (FSDP2 casts outside its graph).
The same values reach the collective.

regather_within_secondary (joint graph) and read_secondary_in_backward (backward graph, after the
cut): node-local re-gathers, ZeRO++'s hpZ, for shard groups with a secondary group
(zero3.shard(secondary_group=...)). Each forward gather G keeps, beside the weight it gathers,
this rank's 1/k slice of it (``dcr::secondary_shard``, k the secondary group's size, pinned
to the forward and banned from recomputation at a price a memory budget may pay): the forward
hands it to the backward, where the weight is re-gathered from the k
slices within the secondary group (tagged MUST_RECOMPUTE: never saved) instead of from the
shards over the whole shard group. In the joint graph the backward's uses of G and of its views
and casts move to that re-gather; after the cut, a gather the backward recomputes anyway (a
forward op the cut recomputes needs its weight) reads the slice too. The slice is the gathered
dtype's (bf16 under cast-before-gather or param_dtype): 2/k bytes per parameter held from the
forward to the backward.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from deepcompile_remat import _C
from deepcompile_remat.fx_arrays import OP_CLASS, PIN_TO_FORWARD, RECOMPUTE_PRICE, output_nodes
from deepcompile_remat.fx_values import OPS, is_view, value_bytes

aten, prims = torch.ops.aten, torch.ops.prims
LOW_PRECISION = (torch.bfloat16, torch.float16)


def is_allgather_cast(node: fx.Node) -> bool:
    """True for a dcr::allgather_cast call in an FX graph."""
    return node.op == "call_function" and node.target is OPS.allgather_cast.default


def _dtype_argument(node: fx.Node):
    """The dtype argument (the fourth) of one of our collectives, positional or keyword."""
    return node.kwargs.get("dtype", node.args[3] if len(node.args) > 3 else None)


def gather_dtype(node: fx.Node):
    """The dtype argument of a dcr::allgather_cast node, positional or keyword; None: no cast."""
    return _dtype_argument(node)


def _scattered_grads(node: fx.Node) -> list:
    """The full-gradient nodes a reduce-scatter node (single or bucket) sends."""
    return list(node.args[0]) if isinstance(node.args[0], (list, tuple)) else [node.args[0]]


def scatter_dtype(node: fx.Node):
    """The dtype a dcr::reduce_scatter_grad or _bucket node reduces in: its dtype argument,
    else its gradients' own."""
    dtype = _dtype_argument(node)
    return dtype if dtype is not None else _scattered_grads(node)[0].meta["val"].dtype


def scattered_bytes(node: fx.Node) -> float:
    """The bytes of full gradient a reduce-scatter node (single or bucket) sends: its
    gradients' elements in the dtype it reduces in."""
    grads = _scattered_grads(node)
    itemsize = scatter_dtype(node).itemsize
    return float(sum(value_bytes(g.meta.get("val")) / g.meta["val"].element_size() * itemsize
                     for g in grads))


def _copy_vals(node: fx.Node):
    """(output, input) fake tensors of an aten._to_copy node, or None if `node` is not one (or
    either value is not a tensor)."""
    if node.op != "call_function" or node.target is not aten._to_copy.default:
        return None
    val, src = node.meta.get("val"), node.args[0].meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(src, torch.Tensor):
        return None
    return val, src


def _cast_target_dtype(node: fx.Node):
    """The dtype a pure dtype conversion produces, or None if `node` is not one."""
    if node.op == "call_function" and node.target is prims.convert_element_type.default:
        return node.args[1]
    vals = _copy_vals(node)
    if vals is None or set(node.kwargs) - {"dtype", "layout", "device"}:
        return None
    val, src = vals
    if val.device != src.device or val.layout != src.layout:
        return None
    return node.kwargs.get("dtype")


def _refresh_meta(node: fx.Node) -> None:
    """Recomputes meta['val'] of a node from its inputs' on fake tensors (a view after its
    input changed dtype, a copy the pass inserted)."""
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


def _host_to_device_copy(node: fx.Node):
    """The host tensor `node` copies to another device with aten._to_copy (no dtype change),
    else None."""
    vals = _copy_vals(node)
    if vals is None:
        return None
    val, src = vals
    if src.device.type != "cpu" or val.device == src.device or val.dtype != src.dtype:
        return None
    return node.args[0]


def narrow_host_copies(gm: fx.GraphModule) -> int:
    """Rewrites the graph in place (module docstring); returns how many host copies now cross
    the link in the narrower dtype."""
    rewritten = 0
    for copy in list(gm.graph.nodes):
        host = _host_to_device_copy(copy)
        if host is None or not copy.users:
            continue
        dtypes = {gather_dtype(u) if is_allgather_cast(u) and u.args[0] is copy else None
                  for u in copy.users}
        if len(dtypes) != 1 or not dtypes <= set(LOW_PRECISION):
            continue  # a reader needs the full-precision values (or two dtypes are read)
        (dtype,) = dtypes
        wide = copy.meta["val"].dtype
        if wide.itemsize <= dtype.itemsize:
            continue
        with gm.graph.inserting_before(copy):
            cast = gm.graph.call_function(aten._to_copy.default, (host,), {"dtype": dtype})
            moved = gm.graph.call_function(aten._to_copy.default, (cast,),
                                           {**copy.kwargs, "dtype": dtype})
            widened = gm.graph.call_function(aten._to_copy.default, (moved,), {"dtype": wide})
        for node in (cast, moved, widened):
            _refresh_meta(node)
        copy.replace_all_uses_with(widened)
        gm.graph.erase_node(copy)
        rewritten += 1
    if rewritten:
        gm.graph.lint()
    return rewritten


# On a joint-graph gather that has a secondary shard (and on its copies in the extracted
# graphs): (the secondary shard node's name, k, the secondary group's name).
SECONDARY_META = "dcr_secondary"
# On a secondary shard node (and the backward's placeholder for it): (k, secondary group name).
SECONDARY_SHARD_META = "dcr_secondary_shard"
# What not keeping a secondary shard costs, in the flops the memory-budget sweep prices
# recomputation in: the weight's backward re-gather then crosses nodes, about all of its bytes
# (the (W-1)/W of a ring over W ranks), at ~8000 flops a byte: an H100's ~400 TFLOP/s of bf16
# matmuls against a 400 Gb/s NIC's 50 GB/s. Outside budget mode the shard is simply kept.
FLOPS_PER_CROSSING_BYTE = 8000


def price_regathers(gm: fx.GraphModule) -> int:
    """Sets each joint-graph gather's recompute price (fx_arrays.RECOMPUTE_PRICE): its full
    weight's bytes at FLOPS_PER_CROSSING_BYTE, what running it again in the backward costs in
    the budget sweep's flops. It matters only where the cut may choose between keeping a
    gathered weight and re-gathering it (the ZeRO-3 marking off, in memory-budget or
    peak-target mode: planning/peak_target.py); the marking forces the re-gather otherwise. One
    price for every gather, pessimistic for a gather inside a node (NVLink moves ~9x the bytes
    of a NIC): it errs towards keeping a weight gathered. Returns how many it priced."""
    priced = 0
    for node in gm.graph.nodes:
        if is_allgather_cast(node):
            full = node.meta["val"]
            node.meta[RECOMPUTE_PRICE] = (
                full.numel() * full.element_size() * FLOPS_PER_CROSSING_BYTE)
            priced += 1
    return priced


def _needed_by(outputs: list) -> set:
    """Every node `outputs` depend on, themselves included."""
    seen, stack = set(), list(outputs)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _aliases_of(gather: fx.Node) -> list:
    """`gather` and the views and casts reached from it (the ZeRO-3 marking's parameter
    aliases, less getitems), in graph order."""
    found, frontier = {gather}, [gather]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user not in found and user.args and user.args[0] is node and (
                    is_view(user) or _cast_target_dtype(user) is not None):
                found.add(user)
                frontier.append(user)
    order = {n: i for i, n in enumerate(gather.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def regather_within_secondary(gm: fx.GraphModule, num_fwd_outputs: int, secondary_of) -> int:
    """Rewrites the joint graph in place (module docstring); secondary_of(group_name) -> (k,
    secondary group name) or None. Returns how many gathers now keep a secondary shard (those
    whose weight the backward reads)."""
    from torch.utils.checkpoint import CheckpointPolicy

    graph = gm.graph
    forward = _needed_by(output_nodes(gm, num_fwd_outputs)[0])
    order = {n: i for i, n in enumerate(graph.nodes)}
    rewritten = 0
    for gather in [n for n in graph.nodes if is_allgather_cast(n)]:
        secondary = secondary_of(gather.args[2])
        if secondary is None:
            continue
        parts, group_name = secondary
        aliases = _aliases_of(gather)
        members = set(aliases)
        backward_uses = [(user, alias) for alias in aliases for user in alias.users
                         if user not in members and user not in forward]
        if not backward_uses:
            continue
        full = gather.meta["val"]
        with graph.inserting_after(gather):
            sec = graph.call_function(OPS.secondary_shard.default, (gather, parts, group_name))
        sec.meta["val"] = full.new_empty(full.numel() // parts)
        # Pinned to the forward, where a compute-intensive op's ban keeps it: saved. The
        # memory-budget sweep may recompute it instead at its price (read_secondary_in_backward
        # then re-gathers from the shard, over the shard group).
        sec.meta[PIN_TO_FORWARD] = True
        # A copy out of the gathered weight, not one of its aliases: banned from recomputation
        # at a price, as a compute-intensive op is (recomputing it takes a re-gather).
        sec.meta[OP_CLASS] = int(_C.OpClass.COMPUTE_INTENSIVE)
        sec.meta[RECOMPUTE_PRICE] = (
            full.numel() * full.element_size() * FLOPS_PER_CROSSING_BYTE)
        sec.meta[SECONDARY_SHARD_META] = secondary
        first = min((user for user, _ in backward_uses), key=order.__getitem__)
        copies = {}
        with graph.inserting_before(first):
            regather = graph.call_function(OPS.allgather_cast.default,
                                           (sec, parts, group_name, None))
            regather.meta["val"] = full.new_empty(full.shape)
            regather.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            copies[gather] = regather
            for alias in aliases[1:]:
                new = graph.node_copy(alias, lambda n: copies.get(n, n))
                new.meta.pop("recompute", None)  # a region's tag on the forward's copy
                new.meta.pop("ac_graph_id", None)
                copies[alias] = new
        for user, alias in backward_uses:
            user.replace_input_with(alias, copies[alias])
        for alias in reversed(aliases[1:]):
            if not copies[alias].users:
                graph.erase_node(copies[alias])
        gather.meta[SECONDARY_META] = (sec.name, parts, group_name)
        rewritten += 1
    if rewritten:
        graph.lint()
    return rewritten


def read_secondary_in_backward(bw: fx.GraphModule) -> tuple[int, int, int, int]:
    """After the cut: each gather the backward recomputes from a shard whose secondary shard
    the forward handed over re-gathers from that slice instead. A slice the cut did not keep
    (a memory budget priced it away) would be cut again in the backward from a re-gather over
    the shard group: that re-gather serves directly. Returns (re-gathers from secondary
    shards, the bytes they gather (full weights), the bytes of the secondary shards the
    backward reads, secondary shards dropped)."""
    secondaries = {n.name: n for n in bw.graph.find_nodes(op="placeholder")
                   if SECONDARY_SHARD_META in n.meta}

    def nbytes(node):
        return node.meta["val"].numel() * node.meta["val"].element_size()

    dropped = 0
    for sec in list(bw.graph.find_nodes(op="call_function", target=OPS.secondary_shard.default)):
        full = sec.args[0]  # the recomputed gather (over the shard group)
        for regather in [u for u in sec.users if is_allgather_cast(u)]:
            regather.replace_all_uses_with(full)
            bw.graph.erase_node(regather)
        if not sec.users:
            bw.graph.erase_node(sec)
            dropped += 1
    regathers = gathered = 0
    first_from: dict = {}  # secondary shard -> its first re-gather in the backward
    for node in [n for n in bw.graph.nodes if is_allgather_cast(n)]:
        meta = node.meta.get(SECONDARY_META)
        sec = secondaries.get(meta[0]) if meta else None
        if sec is not None:
            node.args, node.kwargs = (sec, meta[1], meta[2], None), {}
            node.meta.pop("eager_input_vals", None)  # the shard's: inductor would check them
        source = node.args[0]
        if secondaries.get(getattr(source, "name", None)) is not source:
            continue
        if source in first_from:
            # The joint graph's re-gather for the backward's own uses and the cut's recomputed
            # gather for a forward op it redoes: one weight, gathered once (the earlier one
            # comes before every user of either).
            node.replace_all_uses_with(first_from[source])
            bw.graph.erase_node(node)
            continue
        first_from[source] = node
        regathers += 1
        gathered += nbytes(node)
    return regathers, gathered, sum(nbytes(n) for n in secondaries.values()), dropped


# Ops between a gradient's cast and its reduce-scatter that give the same values in either dtype:
# views, and the zero padding of a gradient to a whole number of shards.
_CAST_COMMUTING = (aten.slice_backward.default,)


def _cast_feeding(node: fx.Node):
    """(cast, the nodes from `node` back to it) where `node` is reached from a float-to-float
    cast through views and zero padding only, each read by the next alone; else None."""
    chain, cur = [], node
    while isinstance(cur, fx.Node) and len(cur.users) == 1 and \
            (is_view(cur) or cur.target in _CAST_COMMUTING):
        chain.append(cur)
        cur = cur.args[0]
    if not isinstance(cur, fx.Node) or len(cur.users) != 1:
        return None
    dtype = _cast_target_dtype(cur)
    src = cur.args[0] if cur.args else None
    if dtype is None or not dtype.is_floating_point or not isinstance(src, fx.Node) or \
            not isinstance(src.meta.get("val"), torch.Tensor) or \
            not src.meta["val"].dtype.is_floating_point:
        return None
    return cur, chain


def fold_reduce_casts(bw: fx.GraphModule) -> int:
    """Rewrites `bw` in place (module docstring); returns how many casts moved into their
    reduce-scatter. A view or zero padding between the two now runs in the gradient's dtype."""
    folded = 0
    for rs in list(bw.graph.find_nodes(op="call_function", target=OPS.reduce_scatter_grad.default)):
        if len(rs.args) > 3 or rs.kwargs:
            continue
        found = _cast_feeding(rs.args[0])
        if found is None:
            continue
        cast, chain = found
        dtype = _cast_target_dtype(cast)
        cast.replace_all_uses_with(cast.args[0])
        bw.graph.erase_node(cast)
        for node in reversed(chain):  # from the cast's old reader on: now in the gradient's dtype
            _refresh_meta(node)
        rs.kwargs = {"dtype": dtype}
        folded += 1
    if folded:
        bw.graph.lint()
        bw.recompile()
    return folded
