"""Gradient reduce-scatters that run under the rest of the backward.

Each dcr::reduce_scatter_grad (and each bucket, dcr::reduce_scatter_grad_bucket) in a backward
graph becomes a start where it stood, as soon as its gradient exists, and a wait placed by the
C++ rule (csrc/schedule/collective_waits.h): as late as the memory budget allows, never after
the first read of its result. The result is a graph output (the shard's gradient, which
autograd then accumulates into .grad, or DeepSpeed's partition), so at the latest the wait is
the last node before the graph returns: a gradient leaves the compiled backward complete, and
gradient accumulation, clipping and the optimizer read it as they would a synchronous one.
Nothing stays in flight past the graph that started it.

What a collective holds in flight, its send buffer (the full gradient, or a bucket's packed
rows) and its output, is read by the wait node, so the memory simulator counts both until the
wait and the compiler neither frees nor reuses them before. The budget is the schedule's
(RematConfig.prefetch_budget_bytes; < 0: the peak of the synchronous placement, overlap for
free).
"""
from __future__ import annotations

import operator
from typing import Iterable, Optional

import numpy as np
import torch
import torch.fx as fx

from deepcompile_remat import _C
from deepcompile_remat.fx_arrays import graph_arrays, memory_graph, priced_scratch
from deepcompile_remat.fx_values import OPS
from deepcompile_remat.zero3.passes import scatter_dtype
from deepcompile_remat.zero3.schedule import apply_order, collective_backends


def _is(node: fx.Node, op) -> bool:
    return node.op == "call_function" and node.target is op.default


def _first_reader(gm: fx.GraphModule, users: Iterable[fx.Node]) -> fx.Node:
    """The first of `users` in graph order, or the output node."""
    users = set(users)
    for node in gm.graph.nodes:
        if node in users:
            return node
    return gm.graph.find_nodes(op="output")[0]


def _split(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.Node, fx.Node]:
    """Replaces one reduce-scatter node by its start (where it stands) and its wait (before
    the first read of its result); returns (start, wait)."""
    dcr, graph = OPS, gm.graph
    if _is(node, dcr.reduce_scatter_grad):
        full_grad, world_size, group_name = node.args[:3]
        dtype = scatter_dtype(node)
        with graph.inserting_before(node):
            if dtype != full_grad.meta["val"].dtype:
                # In flight, the send buffer must be a graph value the wait holds (and the
                # memory simulator counts): the cast folded into the collective comes back out.
                val = full_grad.meta["val"]
                full_grad = graph.call_function(torch.ops.prims.convert_element_type.default,
                                                (full_grad, dtype))
                full_grad.meta["val"] = val.to(dtype)
            start = graph.call_function(dcr.reduce_scatter_grad_start.default,
                                        (full_grad, world_size, group_name))
            start.meta["val"] = node.meta["val"]
        with graph.inserting_before(_first_reader(gm, node.users)):
            wait = graph.call_function(dcr.reduce_scatter_grad_wait.default, (start, full_grad))
        node.replace_all_uses_with(start)
        graph.erase_node(node)
        return start, wait
    # A bucket: its users are the getitems of its members' gradients.
    full_grads, world_size = node.args[0], node.args[1]
    grads = node.meta["val"]
    position = {n: i for i, n in enumerate(graph.nodes)}
    items = sorted(node.users, key=position.__getitem__)
    with graph.inserting_before(node):
        start = graph.call_function(dcr.reduce_scatter_grad_bucket_start.default, node.args,
                                    node.kwargs)
        total = sum(g.meta["val"].numel() for g in full_grads)
        mine_val = grads[0].new_empty(total // world_size)
        start.meta["val"] = (mine_val, grads[0].new_empty(total))
        mine = graph.call_function(operator.getitem, (start, 0))
        rows = graph.call_function(operator.getitem, (start, 1))
        mine.meta["val"], rows.meta["val"] = start.meta["val"]
    first = _first_reader(gm, [u for item in items for u in item.users])
    with graph.inserting_before(first):
        wait = graph.call_function(dcr.reduce_scatter_grad_bucket_wait.default,
                                   (mine, rows, [g.numel() for g in grads]))
        wait.meta["val"] = grads
    node.replace_all_uses_with(wait)
    for item in items:
        first.prepend(item)  # after the wait, in their order
    graph.erase_node(node)
    return start, wait


# Ops whose output is a buffer of its own under inductor too (an extern kernel): reading one
# from a wait costs no extra buffer.
_MATERIALIZED = {"mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward",
                 "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_flash_attention_for_cpu_backward",
                 "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_efficient_attention_backward",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"}


def _materialized(node: fx.Node) -> bool:
    """A tensor that has a buffer of its own under inductor: an extern kernel's output, or an
    item of one's tuple output."""
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    t = node.target
    return (node.op == "call_function" and isinstance(t, torch._ops.OpOverload)
            and t.namespace == "aten" and t.overloadpacket.__name__ in _MATERIALIZED)


def _pin_after_compute(gm: fx.GraphModule, start: fx.Node, wait: fx.Node) -> None:
    """Hands `wait` (as its `after` argument) the nearest materialized tensor computed
    between its start and it, so no compiler moves the wait before that compute: inductor
    reorders for peak memory and would run a wait that frees a send buffer right after its
    start. Nothing between them: the wait is meant to be there anyway."""
    node = wait.prev
    while node is not start and node.op != "placeholder":
        if _materialized(node):
            wait.kwargs = {**wait.kwargs, "after": node}
            return
        node = node.prev


def scatter_backends(gm: fx.GraphModule) -> set:
    """The backends that run `gm`'s gradient reduce-scatters (schedule.collective_backends)."""
    dcr = OPS
    operands = []
    for n in gm.graph.nodes:
        if _is(n, dcr.reduce_scatter_grad):
            operands.append((n.args[0], n.args[2]))
        elif _is(n, dcr.reduce_scatter_grad_bucket):
            operands.append((n.args[0][0], n.args[2]))
    return collective_backends(operands)


def split_reduce_scatters(gm: fx.GraphModule, prefetch_budget_bytes: float,
                          max_in_flight: Optional[int] = None,
                          persistent_names: Iterable[str] = ()) -> tuple[int, int]:
    """Rewrites `gm` in place (module docstring); max_in_flight: at most this many
    reduce-scatters outstanding (None: the budget alone bounds them); persistent_names: inputs
    that live anyway (parameter shards). Returns (collectives split, most in flight at once)."""
    dcr = OPS
    scatters = [n for n in gm.graph.nodes
                if _is(n, dcr.reduce_scatter_grad) or _is(n, dcr.reduce_scatter_grad_bucket)]
    if not scatters:
        return 0, 0
    pairs = [_split(gm, n) for n in scatters]
    exported = graph_arrays(gm)
    memory = memory_graph(gm, persistent_names, graph=exported, workspace=priced_scratch(gm))
    ids = exported.ids
    order = np.flatnonzero(memory.is_input == 0).astype(np.int64)
    placed = _C.place_collective_waits(
        memory, order=order, starts=np.asarray([ids[s] for s, _ in pairs], dtype=np.int64),
        waits=np.asarray([ids[w] for _, w in pairs], dtype=np.int64),
        prefetch_budget_bytes=float(prefetch_budget_bytes), max_in_flight=int(max_in_flight or 0))
    apply_order(gm, exported.nodes, memory.is_input, placed.order)
    for start, wait in pairs:
        _pin_after_compute(gm, start, wait)
    gm.graph.lint()
    gm.recompile()
    return len(pairs), int(placed.max_in_flight)
