"""Collective bucket sizes read from the graph (RematConfig.bucket_bytes = "auto", the default):
one gather and one reduce-scatter per layer, as FSDP2's per-layer units give.

    settings, sizes = resolve_auto(settings, joint)  # after the joint rewrites (cast-before-gather)
    settings, sizes = resolve_auto(settings, fw, bw)  # or over a cut's two graphs

A layer is the module path up to its first index into a container (`model.layers.3`, `h.0`,
`encoder.block.5`), read from the nn_module_stack torch.compile records on each node (a
reduce-scatter: the forward's, fwd_nn_module_stack). Per layer, the bytes its parameters'
gathers move (in the gathered dtype: bf16 under autocast with cast-before-gather) and the
bytes of their full gradients (what the reduce-scatters read) are summed. The gather bucket is
the largest layer's gathered bytes and the gradient bucket its gradient bytes, so the
schedule's packer (csrc/schedule/buckets.h) can put a whole layer in one collective each way
and never a layer and a half. A graph with no indexed layer (one block compiled on its own, a
small model) is one unit: its whole gathered and gradient bytes. Either size is capped at
CAP_BYTES, which bounds what one bucket holds beyond what a per-layer FSDP2 unit would.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch.fx as fx

from deepcompile_remat.fx_values import OPS, value_bytes
from deepcompile_remat.zero3.passes import scattered_bytes
from deepcompile_remat.zero3.schedule import ScheduleOptions

CAP_BYTES = 1 << 28  # 256 MiB: the most one automatic bucket holds
_DYNAMO_ROOT = re.compile(r"^L\['[^']*'\]\.?")
_INDEX = re.compile(r"\.(\d+)(?=\.|$)|\[(\d+)\]|\['(\d+)'\]")


@dataclass(frozen=True, slots=True)
class LayerBucketSizes:
    """What "auto" chose for one graph, and from what."""
    gather_bytes: float   # the largest layer's gathered bytes (capped)
    grad_bytes: float     # the largest layer's full-gradient bytes (capped)
    layers: int           # indexed layers found (0: the graph is one unit)
    largest_layer: str    # its module path ('' for the one unit)

    def summary(self) -> str:
        """One phrase for the report's summary line."""
        where = (f"the largest of {self.layers} layers, {self.largest_layer}" if self.layers
                 else "the graph as one unit")
        return (f"; buckets from the graph ({where}): gathers {self.gather_bytes:.0f} bytes, "
                f"reduce-scatters {self.grad_bytes:.0f} bytes")


def layer_of(module_path: str) -> str:
    """`module_path` up to its first container index ('' where it has none)."""
    m = _INDEX.search(module_path)
    return module_path[:m.end()] if m else ""


def _innermost_path(node: fx.Node, key: str) -> Optional[str]:
    stack = node.meta.get(key)
    if not stack:
        return None
    path = list(stack.values())[-1]
    path = path[0] if isinstance(path, tuple) else str(path)
    return _DYNAMO_ROOT.sub("", path)  # "L['self'].model.layers.0" -> "model.layers.0"


def layer_bucket_sizes(gathers: fx.GraphModule,
                       scatters: Optional[fx.GraphModule] = None) -> LayerBucketSizes:
    """The bucket sizes of "auto" (module docstring), from the parameter gathers of
    `gathers` and the gradient reduce-scatters of `scatters` (default: the same graph; a
    joint graph has both once, a cut's forward the gathers and its backward the scatters)."""
    gathered: dict[str, float] = {}
    grads: dict[str, float] = {}
    for node in gathers.graph.find_nodes(op="call_function", target=OPS.allgather_cast.default):
        if node.args[0].op == "placeholder":  # a shard's gather, not a re-gather of a slice
            layer = layer_of(_innermost_path(node, "nn_module_stack") or "")
            gathered[layer] = gathered.get(layer, 0) + value_bytes(node.meta.get("val"))
    scatters = gathers if scatters is None else scatters
    for node in scatters.graph.find_nodes(op="call_function",
                                          target=OPS.reduce_scatter_grad.default):
        layer = layer_of(_innermost_path(node, "fwd_nn_module_stack") or "")
        grads[layer] = grads.get(layer, 0) + scattered_bytes(node)
    layers = sorted(k for k in set(gathered) | set(grads) if k)
    if not layers:  # one unit: everything it gathers in one collective each way
        return LayerBucketSizes(float(min(sum(gathered.values()), CAP_BYTES)),
                                float(min(sum(grads.values()), CAP_BYTES)), 0, "")
    largest = max(layers, key=lambda k: (gathered.get(k, 0), grads.get(k, 0), k))
    return LayerBucketSizes(float(min(max(gathered.get(k, 0) for k in layers), CAP_BYTES)),
                            float(min(max(grads.get(k, 0) for k in layers), CAP_BYTES)),
                            len(layers), largest)


def resolve_auto(settings: ScheduleOptions, gathers: fx.GraphModule,
                 scatters: Optional[fx.GraphModule] = None
                 ) -> tuple[ScheduleOptions, Optional[LayerBucketSizes]]:
    """`settings` with "auto" bucket sizes (None) read from the graphs (layer_bucket_sizes),
    and what was read; settings whose sizes are set come back as they are, with None."""
    if settings.bucket_bytes is not None and settings.grad_bucket_bytes is not None:
        return settings, None
    sizes = layer_bucket_sizes(gathers, scatters)
    return settings.with_bucket_bytes(sizes.gather_bytes, sizes.grad_bytes), sizes
