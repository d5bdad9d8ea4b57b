"""The simulated peak of an FX graph in its own order (csrc/memsim), as a fusing compiler
would run it.

    peak, resident = graph_peak(gm, persistent_names=parameter_names)
    step, fw_peak, bw_peak, resident = step_peak(fw, bw, parameter_names)
"""
from __future__ import annotations

from typing import Iterable

import numpy as np
import torch
import torch.fx as fx

from deepcompile_remat import _C, fx_arrays
from deepcompile_remat.fx_arrays import COPIED_WHEN_SAVED
from deepcompile_remat.fx_values import value_bytes
from deepcompile_remat.partition.op_classes import OpClass, classify

_FUSED = (OpClass.POINTWISE, OpClass.CAST)  # ops a fusing compiler inlines into their reader
_FUSING_READERS = (OpClass.POINTWISE, OpClass.CAST, OpClass.REDUCTION)
# A convolution's backward allocates and frees, inside its own call, about twice its weight:
# measured on CPU (oneDNN), a reordered copy of the weight and a scratch weight gradient
# (resnet-basic fp32: 2.49 + 2.36 MB beside a 2.36 MB weight; benchmarks/README.md, the vision
# cells of peak-plan). cuDNN's workspace is not measured; it is taken to be the same.
CONV_BACKWARD_SCRATCH_WEIGHTS = 2.0


def fused_away(gm: fx.GraphModule) -> set:
    """The nodes a fusing compiler (inductor) never writes to memory: a pointwise op or cast
    that is no graph output and whose one reader is a pointwise op, a cast or a reduction,
    into whose kernel it is inlined. An approximation: inductor also fuses through views, and
    into several readers where they share a kernel; a value read by two kernels is written."""
    outputs = set(gm.graph.find_nodes(op="output")[0].all_input_nodes)
    kinds = {n: classify(n) for n in gm.graph.nodes}
    return {n for n in gm.graph.nodes
            if kinds[n] in _FUSED and n not in outputs and len(n.users) == 1
            and kinds[next(iter(n.users))] in _FUSING_READERS}


def op_workspace(gm: fx.GraphModule) -> dict:
    """Scratch bytes of the nodes whose op allocates some inside its own call (alive only at
    that node's step): each convolution backward, CONV_BACKWARD_SCRATCH_WEIGHTS x its weight,
    and what the graph's owner priced in a node's meta (fx_arrays.SCRATCH_BYTES: a runtime's
    collectives)."""
    conv_backward = torch.ops.aten.convolution_backward.default
    out = fx_arrays.priced_scratch(gm)
    for n in gm.graph.find_nodes(op="call_function", target=conv_backward):
        weight = n.args[2]
        if isinstance(weight, fx.Node):
            out[n] = CONV_BACKWARD_SCRATCH_WEIGHTS * value_bytes(weight.meta.get("val"))
    return out


def graph_peak(gm: fx.GraphModule, persistent_names: Iterable[str],
               fuses_pointwise: bool = True) -> tuple[float, float]:
    """(simulated peak, bytes of its persistent inputs) of `gm` in its own order: the inputs
    named in persistent_names (the parameters) live before and after it, so a step's peak
    above its memory at rest is the first less the second. fuses_pointwise: its compiler
    fuses (fused_away nodes allocate nothing). Ops' scratch counts at their step (op_workspace)."""
    arrays = fx_arrays.graph_arrays(gm)
    memory = fx_arrays.memory_graph(gm, persistent_names, graph=arrays,
                                    no_buffer=fused_away(gm) if fuses_pointwise else (),
                                    workspace=op_workspace(gm))
    is_input = np.asarray(memory.is_input)
    order = np.flatnonzero(is_input == 0).astype(np.int64)
    resident = float(np.asarray(memory.bytes)[np.asarray(memory.persistent) != 0].sum())
    return float(_C.simulate_memory(memory, order=order).peak_bytes), resident


def step_peak(fw: fx.GraphModule, bw: fx.GraphModule, persistent_names: Iterable[str],
              fuses_pointwise: bool = True) -> tuple[float, float, float, float]:
    """(step peak, forward peak, backward peak, the forward's resident bytes) of a forward and
    backward pair, graph_peak of each, the backward put on the forward's footing: the
    parameters it does not read are resident too. The step peak is the larger of the two.
    A parameter the backward reads that the compiler saves as a copy
    (fx_arrays.COPIED_WHEN_SAVED) is no resident input in either graph: the forward holds
    its copy from the start to the end, the backward until its last use."""
    copies = {n.name for n in bw.graph.find_nodes(op="placeholder")
              if n.meta.get(COPIED_WHEN_SAVED)}
    persistent_names = set(persistent_names) - copies
    fw_peak, fw_resident = graph_peak(fw, persistent_names, fuses_pointwise)
    bw_peak, bw_resident = graph_peak(bw, persistent_names, fuses_pointwise)
    bw_peak += fw_resident - bw_resident
    return max(fw_peak, bw_peak), fw_peak, bw_peak, fw_resident
