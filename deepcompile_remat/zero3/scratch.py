"""What our collectives allocate and free inside their own call: priced for the memory simulator.

A graph value shows what an op returns, not what it allocates on the way. The synchronous
bucket collectives hold, for the length of their call, buffers as large as the bucket
(custom_ops.py; measured in the profiler's live set at the backward's peak, llama 4x512 seq
1024 on 2 gloo ranks, benchmarks/README.md):

- dcr::reduce_scatter_grad_bucket packs its full gradients, S bytes in the dtype it reduces
  in, into one row buffer (S), reduces into this rank's part of it (S / world) and copies each
  member's shard out;
- dcr::reduce_scatter_grad reduces into its output, which it returns, after casting the
  gradient into a send buffer (S) where it reduces in another dtype (passes.fold_reduce_casts);
- on gloo, each reduce-scatter also copies this rank's chunk (S / world) inside the collective;
- dcr::allgather_cast_bucket gathers into one packed buffer (its G output bytes) and copies
  each full parameter out of it.

mark_scratch writes those bytes into each node's meta (fx_arrays.SCRATCH_BYTES), which the
simulator counts at that node's step only: the planner's and the reports' simulations, and
the runtime's own schedules (Zero3Runtime.rewrite prices the graph before them and again as
they make new nodes). The gather schedule, which decides the gather buckets, counts a
bucket's packed buffer itself (csrc/schedule/regather_schedule.h). The split start/wait
forms return their buffers as graph values, which the simulator sees already; gloo's copy
inside a started reduce-scatter is not priced (on NCCL there is none, and "auto" splits
only on NCCL).
"""
from __future__ import annotations

import torch.fx as fx

from deepcompile_remat.fx_arrays import SCRATCH_BYTES
from deepcompile_remat.fx_values import OPS, value_bytes
from deepcompile_remat.zero3.passes import scatter_dtype, scattered_bytes
from deepcompile_remat.zero3.schedule import collective_backends


def _copies_its_chunk(node: fx.Node, operand: fx.Node) -> bool:
    """Whether the collective's group runs gloo, whose reduce-scatter copies this rank's chunk."""
    return collective_backends([(operand, node.args[2])]) == {"gloo"}


def scratch_bytes(node: fx.Node) -> float:
    """The bytes `node`'s op allocates and frees inside its call (0 for any other op)."""
    if node.op != "call_function":
        return 0.0
    if node.target is OPS.reduce_scatter_grad_bucket.default:
        grads, world = node.args[0], node.args[1]
        full = scattered_bytes(node)
        copied = full / world if world > 1 and _copies_its_chunk(node, grads[0]) else 0.0
        return full + full / world + copied
    if node.target is OPS.reduce_scatter_grad.default:
        grad, world = node.args[0], node.args[1]
        full = scattered_bytes(node)
        cast = full if scatter_dtype(node) != grad.meta["val"].dtype else 0.0
        copied = full / world if world > 1 and _copies_its_chunk(node, grad) else 0.0
        return cast + copied
    if node.target is OPS.allgather_cast_bucket.default:
        return value_bytes(node.meta.get("val"))
    return 0.0


def mark_scratch(gm: fx.GraphModule) -> None:
    """Sets fx_arrays.SCRATCH_BYTES on each of `gm`'s nodes whose op has scratch."""
    for node in gm.graph.nodes:
        extra = scratch_bytes(node)
        if extra:
            node.meta[SCRATCH_BYTES] = extra
        else:
            node.meta.pop(SCRATCH_BYTES, None)
