"""Activation offload: a third choice beside saving a value for the backward and recomputing it.

The cut saves what recomputing would cost too much to give up. Such a value can still leave
the accelerator: the forward copies it to the host as soon as it is produced, its accelerator
buffer is freed at its last forward use (not held until the backward), and the backward copies
it back just before its first use. The price is host-link traffic, its bytes twice, which
costs nothing while it runs under compute and stalls the step once it does not:

- a value is a candidate when it is an activation the cut saves (no graph input, no
  parameter, not also returned to the caller), a floating-point tensor of at least MIN_BYTES;
- candidates are taken largest first while the copies of all taken so far cost at most the
  joint graph's flops (recomputing every op once), the link priced in flops per byte. A copy
  the compute cannot cover would cost time that recomputation might spend better, so a
  small model on a slow link offloads little or nothing.

host_link_flops_per_byte prices one byte over the link in the cut's flop units: the
accelerator's flop rate over the link's bandwidth (RematConfig.host_link_flops_per_byte). The
memory simulator counts accelerator bytes only (fx_arrays.ON_HOST): an offloaded value
holds nothing on the accelerator between its copies. Off by default (RematConfig.
offload_activations) until measured on a GPU: on a CPU the "host" is the same memory, so a run
here proves the data path (values, gradients), and the simulator says what a GPU would hold.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.fx as fx

from deepcompile_remat import fx_arrays
from deepcompile_remat.partition import budget

prims = torch.ops.prims
HOST = torch.device("cpu")
MIN_BYTES = 1 << 20  # smaller values are not worth a copy's launch and latency


@dataclass(frozen=True)
class OffloadFigures:
    """What one graph's offload moved (PartitionReport.offload)."""
    values: tuple          # (name, bytes) of each value copied to the host, forward order
    bytes_each_way: int    # their sum: host-bound in the forward, accelerator-bound after
    link_flops: float      # their copies priced in flops (both ways)
    recompute_flops: float  # what recomputing them instead would cost
    candidates: int        # saved activations large enough to move
    # The memory simulator's step peak (the larger of forward and backward, accelerator bytes)
    # of the graphs before and after the offload; 0 when nothing moved.
    simulated_peak_before: float = 0.0
    simulated_peak_after: float = 0.0

    def summary(self) -> str:
        """'; offloaded ...' for the report's summary line."""
        peaks = (f" (simulated step peak {self.simulated_peak_before / 2**20:.1f} -> "
                 f"{self.simulated_peak_after / 2**20:.1f} MiB)" if self.values else "")
        return (f"; offloaded {len(self.values)} of {self.candidates} candidate values to the "
                f"host, {self.bytes_each_way / 2**20:.1f} MiB each way{peaks}")


def _bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
        return 0
    return val.numel() * val.element_size()


def choose(fw: fx.GraphModule, saved_names: Iterable[str], *, num_fwd_outputs: int,
           parameter_names: set, flops_per_byte: float, step_flops: float,
           min_bytes: int = MIN_BYTES) -> tuple[list, int]:
    """(the forward nodes to offload, largest first; how many values were candidates) among
    the saved values `saved_names` of forward graph `fw` (module docstring). A value the
    forward also returns to its caller is no candidate: its buffer outlives the forward
    anyway."""
    by_name = {n.name: n for n in fw.graph.nodes}
    returned = set(_outputs(fw)[:num_fwd_outputs])
    candidates = []
    for name in saved_names:
        node = by_name.get(name)
        if node is None or node.op != "call_function" or name in parameter_names \
                or node in returned:
            continue
        size = _bytes(node)
        if size >= min_bytes:
            candidates.append((size, node))
    chosen, spent = [], 0.0
    for size, node in sorted(candidates, key=lambda c: -c[0]):
        link = 2 * size * flops_per_byte
        if spent + link <= step_flops:
            chosen.append(node)
            spent += link
    return chosen, len(candidates)


def _outputs(gm: fx.GraphModule) -> list:
    out = gm.graph.find_nodes(op="output")[0]
    return list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]


def _copy_to(graph: fx.Graph, value: fx.Node, device: torch.device) -> fx.Node:
    """value copied to `device` (HOST: the forward's copy out; else the backward's copy back,
    which on a CPU run is the same device). prims.device_put, not aten._to_copy: the graphs
    are past AOTAutograd's decompositions, and inductor lowers only the prim."""
    # The copy back is ordered on the stream with what reads it; the copy out lands in
    # pageable host memory, which a GPU copies synchronously (no pinned staging yet).
    copy = graph.call_function(prims.device_put.default, (value, device),
                               {"non_blocking": device != HOST})
    copy.meta["val"] = value.meta["val"].to(device)
    return copy


def apply(fw: fx.GraphModule, bw: fx.GraphModule, chosen: list, *, num_fwd_outputs: int,
          flops_per_byte: float, candidates: int) -> OffloadFigures:
    """Rewrites fw and bw in place: each chosen forward value is handed to the backward as its
    host copy, made right after it is produced; the backward copies it back just before its
    first use. Returns the figures."""
    bw_inputs = {n.name: n for n in bw.graph.find_nodes(op="placeholder")}
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    fw_out = fw.graph.find_nodes(op="output")[0]
    outputs = _outputs(fw)
    values, recompute = [], 0.0
    for node in chosen:
        placeholder = bw_inputs.get(node.name)
        if placeholder is None or not placeholder.users:
            continue  # not handed to the backward under its name: it stays saved
        device = node.meta["val"].device
        with fw.graph.inserting_after(node):
            to_host = _copy_to(fw.graph, node, HOST)
        to_host.meta[fx_arrays.ON_HOST] = True
        outputs = [to_host if i >= num_fwd_outputs and o is node else o
                   for i, o in enumerate(outputs)]
        first_use = min(placeholder.users, key=order.__getitem__)
        placeholder.meta["val"] = to_host.meta["val"]
        placeholder.meta[fx_arrays.ON_HOST] = True
        with bw.graph.inserting_before(first_use):
            back = _copy_to(bw.graph, placeholder, device)
        placeholder.replace_all_uses_with(back, delete_user_cb=lambda u, back=back: u is not back)
        values.append((node.name, _bytes(node)))
        recompute += budget.recompute_cost_of(node)
    if values:
        fw_out.args = (tuple(outputs),)
        for gm in (fw, bw):
            gm.graph.lint()
            gm.recompile()
    moved = sum(b for _, b in values)
    return OffloadFigures(tuple(values), moved, 2 * moved * flops_per_byte, recompute,
                          candidates)
