"""The one compatibility shim over torch's module extraction.

Given the saved values, building the forward and backward GraphModules is torch's job
(``_extract_fwd_bwd_modules``): it knows AOTAutograd's calling convention (saved SymInts
first, opaque objects, static inputs, tangents). Its signature changed across releases, so
we bind by keyword after inspecting it; torch 2.11 (GPU machine) and 2.13 (CI) both work.
"""
from __future__ import annotations

import functools
import inspect

import torch.fx as fx
from torch._functorch import partitioners as _tp


@functools.lru_cache(maxsize=1)
def _extract_params() -> frozenset:
    return frozenset(inspect.signature(_tp._extract_fwd_bwd_modules).parameters)


def extract_fwd_bwd_modules(
    joint_module: fx.GraphModule,
    saved_values: list[fx.Node],
    saved_sym_nodes: list[fx.Node],
    saved_opaque_nodes: list[fx.Node],
    *,
    num_fwd_outputs: int,
    static_lifetime_input_nodes,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Builds (forward, backward) modules; mutates the saved lists to what the backward uses."""
    params = _extract_params()
    kwargs = {"num_fwd_outputs": num_fwd_outputs}
    if "static_lifetime_input_nodes" in params:
        kwargs["static_lifetime_input_nodes"] = static_lifetime_input_nodes
    if "saved_opaque_nodes" in params:
        kwargs["saved_opaque_nodes"] = saved_opaque_nodes
    elif saved_opaque_nodes:
        saved_values = saved_values + saved_opaque_nodes
    fw_module, bw_module = _tp._extract_fwd_bwd_modules(
        joint_module, saved_values, saved_sym_nodes=saved_sym_nodes, **kwargs)
    bw_module = _tp.reordering_to_mimic_autograd_engine(bw_module)
    raise_getitems = getattr(_tp, "raise_getitems", None)
    if raise_getitems is not None:  # getitems early: tuple outputs are freed sooner
        fw_module = raise_getitems(fw_module)
        bw_module = raise_getitems(bw_module)
    thread_rng = getattr(_tp, "thread_graphsafe_rng_from_hops", None)
    if thread_rng is not None:  # RNG-state inputs of partitioned HOP subgraphs (CUDA graphs)
        fw_module = thread_rng(fw_module, is_backward=False)
        bw_module = thread_rng(bw_module, is_backward=True)
    return fw_module, bw_module


def is_sym_node(node: fx.Node) -> bool:
    return _tp.is_sym_node(node)


def is_opaque_node(node: fx.Node) -> bool:
    fn = getattr(_tp, "is_opaque_node", None)
    return bool(fn(node)) if fn is not None else False
