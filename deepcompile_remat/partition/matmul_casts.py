"""Casts that only feed matmuls, shaped so that inductor compiles no kernel for them alone.

    shaped = shape_matmul_casts(bw)   # a backward graph, before inductor compiles it

Under autocast the backward of every linear layer casts an fp32 gradient to bf16 for its two
matmuls: prims.convert_element_type, then a view to 2-D, then mm. A matmul is an extern call,
so inductor must materialize the cast, and it does so through the 2-D view: the cast becomes a
loop nest of its own shape, [S*B, H] against its producer's [B, S, H]. Inductor's C++ backend
fuses a pointwise node into its producer across different loop shapes only when their
original sizes agree (CppScheduling._can_fuse_nodes_with_compatible_ranges), so each such cast
compiles to a kernel of its own, one more than the same layer in bf16 has (benchmarks/README,
"the first step's kernel"), at about 0.65 s of a first step on a 2-core host. Two rewrites,
each exact (the same values, dtypes and strides):

- a cast of a computed value is materialized at its own shape first
  (prims.inductor_force_stride_order with the strides it has), so it shares its producer's
  loops and fuses into the producer's kernel; the view after it is then free;
- a cast of a graph input (the incoming gradient) has no producer to join: it runs as
  dcr_opaque::cast_to, an opaque op that calls aten's cast, so nothing is compiled for it.

Only casts whose every use reaches a matmul through views are touched: a cast read by a
pointwise op is inlined into that op's kernel already, and materializing it would add a
buffer.
"""
from __future__ import annotations

import torch
import torch.fx as fx

_aten = torch.ops.aten
_CAST = torch.ops.prims.convert_element_type.default
_VIEWS = frozenset({_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default,
                    _aten.permute.default, _aten.t.default, _aten.transpose.int})
_MATMULS = frozenset({_aten.mm.default, _aten.bmm.default, _aten.addmm.default,
                      _aten.baddbmm.default})


# Not fx_values.OP_NAMESPACE: that names the collectives, which the ordering pass
# (zero3/collective_order.py) chains and the agreement key counts.
NAMESPACE = "dcr_opaque"


@torch.library.custom_op(f"{NAMESPACE}::cast_to", mutates_args=())
def cast_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype, a new tensor with x's strides (what prims.convert_element_type gives)."""
    return x.to(dtype, copy=True)


@cast_to.register_fake
def _(x, dtype):
    return torch.empty_like(x, dtype=dtype)


def _feeds_only_matmuls(node: fx.Node) -> bool:
    """Every use of node reaches a matmul operand through view-like ops, and there is one."""
    users = list(node.users)
    if not users:
        return False
    for user in users:
        if user.op != "call_function":
            return False
        if user.target in _MATMULS:
            continue
        if user.target not in _VIEWS or user.args[0] is not node or \
                not _feeds_only_matmuls(user):
            return False
    return True


def _dense(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_contiguous()


def shape_matmul_casts(gm: fx.GraphModule) -> int:
    """Rewrites gm's matmul-only casts as the module docstring says; returns how many."""
    import torch._inductor.inductor_prims  # noqa: F401  (registers inductor_force_stride_order)

    graph = gm.graph
    shaped = 0
    for node in list(graph.nodes):
        if node.target is not _CAST or not _feeds_only_matmuls(node):
            continue
        source, value = node.args[0], node.meta.get("val")
        source_value = source.meta.get("val") if isinstance(source, fx.Node) else None
        if not (_dense(value) and _dense(source_value)) or value.dtype == source_value.dtype:
            continue
        if source.op == "placeholder":
            with graph.inserting_after(node):
                opaque = graph.call_function(cast_to._opoverload,
                                             (source, node.args[1]))
            opaque.meta = dict(node.meta)
            node.replace_all_uses_with(opaque)
            graph.erase_node(node)
        else:
            with graph.inserting_after(node):
                realized = graph.call_function(
                    torch.ops.prims.inductor_force_stride_order.default,
                    (node, tuple(value.stride())))
            realized.meta = dict(node.meta)
            node.replace_all_uses_with(realized, delete_user_cb=lambda user: user is not realized)
        shaped += 1
    if shaped:
        graph.lint()
        gm.recompile()
    return shaped
