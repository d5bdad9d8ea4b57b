"""Which forward inputs inductor copies when the forward hands them to the backward.

Inductor's layout optimization (on for graphs with convolutions: always on CPU with oneDNN, by
a heuristic on GPUs) stores every 4-D value on the way to a convolution channels-last,
forward outputs included. A parameter saved for the backward is such an output: a contiguous
conv weight is written out as a channels-last copy and held until the backward, which reads
the copy. So saving it is not free. Under bf16 autocast the copy is full precision, twice the
bytes of the cast that torch's partitioner saves instead (benchmarks/README.md, cut-quality:
a basic-block ResNet's step peak was 27% above torch's before the cut knew this).

    copied = copied_when_saved(joint_module, num_fwd_outputs)   # placeholders
    mark_copied_when_saved(joint_module, num_fwd_outputs)       # node.meta, for the cut

The mark (fx_arrays.COPIED_WHEN_SAVED) is read where the joint graph is exported (the cut
prices saving the input) and by the memory simulator (a saved one's copy is counted).
"""
from __future__ import annotations

import logging

import torch
import torch.fx as fx

from deepcompile_remat.fx_arrays import COPIED_WHEN_SAVED, output_nodes

log = logging.getLogger(__name__)

_CONVOLUTION = torch.ops.aten.convolution.default
_STOPS_PROPAGATION = (torch.ops.aten.bmm.default,)  # as inductor: bmm takes no layout preference


def _forward_nodes(gm: fx.GraphModule, num_fwd_outputs: int) -> list[fx.Node]:
    """The nodes the forward outputs need, in graph order (the forward inductor compiles)."""
    needed, stack = set(), list(output_nodes(gm, num_fwd_outputs)[0])
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(n.all_input_nodes)
    return [n for n in gm.graph.nodes if n in needed]


def _inductor_lays_out_channels_last(forward: list[fx.Node]) -> bool:
    """inductor's own decision (GraphLowering.decide_layout_opt) for this forward; False where
    this torch has no such function."""
    try:
        from torch._inductor.graph import GraphLowering
    except ImportError:
        return False
    decide = getattr(GraphLowering, "decide_layout_opt", None)
    if decide is None:
        log.debug("this torch's inductor has no decide_layout_opt: no input counted as copied")
        return False

    class _Forward:  # decide_layout_opt reads gm.graph.nodes only
        class graph:
            nodes = forward

    return bool(decide(_Forward, is_inference=False))


def copied_when_saved(gm: fx.GraphModule, num_fwd_outputs: int) -> set[fx.Node]:
    """The placeholders of joint graph `gm` that inductor would save as a channels-last copy:
    where it lays the forward out channels-last, each dense 4-D input whose strides are not
    channels-last already (a 1x1 conv weight's are: it is saved as it is) and from which the
    forward reaches a convolution (inductor's rule: a value prefers channels-last when a user
    of it does)."""
    if not gm.graph.find_nodes(op="call_function", target=_CONVOLUTION):
        return set()  # FX indexes nodes by target: no walk of a graph without convolutions
    forward = _forward_nodes(gm, num_fwd_outputs)
    if not _inductor_lays_out_channels_last(forward):
        return set()
    prefers = set()
    for n in reversed(forward):
        if n.target is _CONVOLUTION or (n.target not in _STOPS_PROPAGATION
                                        and any(u in prefers for u in n.users)):
            prefers.add(n)
    copied = set()
    for n in prefers:
        val = n.meta.get("val")
        if (n.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() == 4
                and not val.is_contiguous(memory_format=torch.channels_last)
                and torch._prims_common.is_non_overlapping_and_dense_or_false(val)):
            copied.add(n)
    return copied


def mark_copied_when_saved(gm: fx.GraphModule, num_fwd_outputs: int) -> None:
    """Sets fx_arrays.COPIED_WHEN_SAVED on copied_when_saved(gm, num_fwd_outputs)."""
    for n in copied_when_saved(gm, num_fwd_outputs):
        n.meta[COPIED_WHEN_SAVED] = True
