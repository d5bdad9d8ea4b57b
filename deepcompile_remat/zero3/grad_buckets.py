"""Bucketed gradient reduce-scatters: small gradients share one collective.

Every parameter's gradient leaves the backward through its own dcr::reduce_scatter_grad, and a
collective costs a fixed latency whatever its size (benchmarks/README.md gives gloo's and
NCCL's). Layer norms and biases make most of the calls and few of
the bytes, so the small ones (full gradient of at most `bucket_bytes`) are packed, in the
order the backward produces them, into dcr::reduce_scatter_grad_bucket calls of at most
`bucket_bytes` in all. A bucket is issued where its last member was; the members before it
stay alive until then, which costs at most `bucket_bytes` of memory. Large gradients keep
their own collective at their own place.

The rule is C++'s (csrc/schedule/buckets.h, BucketReduceScatters); this module exports the
graph (fx_arrays) and applies the buckets. Every rank runs the same pass on the same graph, so
the buckets, and the collectives, line up.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.fx as fx

from deepcompile_remat import _C
from deepcompile_remat.fx_arrays import compatibility_keys, graph_arrays
from deepcompile_remat.fx_values import OPS
from deepcompile_remat.zero3.bucketing import members_by_bucket, replace_with_bucket
from deepcompile_remat.zero3.passes import scatter_dtype, scattered_bytes


def _is_reduce_scatter(node: fx.Node) -> bool:
    return node.op == "call_function" and \
        node.target is OPS.reduce_scatter_grad.default


def _reduce_scatter_key(node: fx.Node) -> tuple:
    """What a bucket's members must share: world size, group, the dtype they are reduced in
    and device (one send buffer per bucket; each gradient is cast into it as it is packed)."""
    full = node.args[0].meta["val"]
    return node.args[1], node.args[2], scatter_dtype(node), str(full.device)


def bucket_reduce_scatters(gm: fx.GraphModule, bucket_bytes: float) -> int:
    """Rewrites `gm` in place; returns how many bucket collectives replaced >= 2 others."""
    graph = graph_arrays(gm)
    ids = graph.ids
    candidates = [n for n in graph.nodes if _is_reduce_scatter(n)
                  and isinstance(n.args[0].meta.get("val"), torch.Tensor)]
    if not candidates:
        return 0
    bucket_of = _C.bucket_reduce_scatters(
        num_nodes=len(graph.nodes), edge_tails=graph.edge_tails, edge_heads=graph.edge_heads,
        candidates=np.asarray([ids[n] for n in candidates], dtype=np.int64),
        bytes=np.asarray([scattered_bytes(n) for n in candidates], dtype=np.float64),
        keys=compatibility_keys([_reduce_scatter_key(n) for n in candidates]),
        bucket_bytes=float(bucket_bytes))
    buckets = members_by_bucket(candidates, bucket_of)
    for members in buckets:
        last = members[-1]
        dtype = scatter_dtype(last)
        cast = any(m.args[0].meta["val"].dtype != dtype for m in members)
        replace_with_bucket(gm, members, last, OPS.reduce_scatter_grad_bucket.default,
                            ([m.args[0] for m in members], last.args[1], last.args[2]),
                            {"dtype": dtype} if cast else {})
    if buckets:
        gm.graph.lint()
        gm.recompile()
    return len(buckets)
