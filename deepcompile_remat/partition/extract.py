"""Builds the forward and backward modules from the cut: ours, else torch's helper.

Our extraction (extract_fast.py) builds the same modules as torch's path at a fraction of
the cost. Where it does not cover a graph (extract_fast.unsupported_reason, or Unsupported
raised while building: opaque objects, recomputed random ops, HOP RNG threading, ...), the
modules come from torch's ``_extract_fwd_bwd_modules`` and the passes torch runs after it.
The choice is explicit and logged at debug level, never a silent difference.

torch's helper knows AOTAutograd's calling convention (saved SymInts first, opaque objects,
static inputs, tangents). Its signature changed across releases, so we bind by keyword after
inspecting it; torch 2.11 (GPU machine) and 2.13 (CI) both work.

Random ops the cut recomputes (only seeded ones inside a checkpoint region: see
csrc/partition/remat_partition.h) get their forward RNG state saved and replayed in the
backward by torch's own ``functionalize_rng_ops`` (run_and_save_rng_state in the forward,
run_with_rng_state in the backward), and ``check_no_random_op_redrawn`` then proves that no
random op runs in both graphs without it.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch.fx as fx
from torch._functorch import partitioners as _tp

from deepcompile_remat.partition import extract_fast, op_classes

log = logging.getLogger(__name__)


def extract_fwd_bwd_modules(joint_module: fx.GraphModule, saved_values: list[fx.Node],
                            saved_sym_nodes: list[fx.Node], saved_opaque_nodes: list[fx.Node], *,
                            num_fwd_outputs: int, static_lifetime_input_nodes,
                            times: Optional[dict] = None) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Builds (forward, backward) modules; mutates the saved lists to what the backward uses.
    Our extraction where it covers the graph, else torch's (module docstring). `times`, if
    given, receives 'path' ("ours" or "torch: <reason>") and ours' phase seconds."""
    reason = extract_fast.unsupported_reason(joint_module, saved_values, saved_sym_nodes,
                                             saved_opaque_nodes)
    if reason is None:
        try:
            fw_module, bw_module = extract_fast.extract_modules(
                joint_module, saved_values, saved_sym_nodes, num_fwd_outputs=num_fwd_outputs,
                times=times)
        except extract_fast.Unsupported as err:
            reason = str(err)
        except Exception as err:  # a bug of ours must not fail the user's compile
            reason = f"our extraction failed ({err!r})"
            log.warning("deepcompile_remat: %s; using torch's. Please report this with the "
                        "graph.", reason, exc_info=True)
        else:
            check_no_random_op_redrawn(fw_module, bw_module)
            if times is not None:
                times["path"] = "ours"
            return fw_module, bw_module
    log.debug("deepcompile_remat: torch's module extraction, because %s", reason)
    if times is not None:
        times["path"] = f"torch: {reason}"
    return torch_extract_fwd_bwd_modules(
        joint_module, saved_values, saved_sym_nodes, saved_opaque_nodes,
        num_fwd_outputs=num_fwd_outputs, static_lifetime_input_nodes=static_lifetime_input_nodes)


def torch_extract_fwd_bwd_modules(joint_module: fx.GraphModule, saved_values: list[fx.Node],
                                  saved_sym_nodes: list[fx.Node],
                                  saved_opaque_nodes: list[fx.Node], *, num_fwd_outputs: int,
                                  static_lifetime_input_nodes
                                  ) -> tuple[fx.GraphModule, fx.GraphModule]:
    """torch's path: its helper, RNG replay of recomputed random ops, the autograd-engine
    reordering, raised getitems and HOP RNG threading. Mutates the saved lists as above."""
    params = extract_fast.torch_helper_params()
    kwargs = {"num_fwd_outputs": num_fwd_outputs}
    if "static_lifetime_input_nodes" in params:
        kwargs["static_lifetime_input_nodes"] = static_lifetime_input_nodes
    if "saved_opaque_nodes" in params:
        kwargs["saved_opaque_nodes"] = saved_opaque_nodes
    elif saved_opaque_nodes:
        saved_values = saved_values + saved_opaque_nodes
    fw_module, bw_module = _tp._extract_fwd_bwd_modules(
        joint_module, saved_values, saved_sym_nodes=saved_sym_nodes, **kwargs)
    if recomputed_random_ops(fw_module, bw_module):
        # saved_sym_nodes now holds what the backward takes: the forward returns them last.
        fw_module, bw_module = _tp.functionalize_rng_ops(
            joint_module, fw_module, bw_module, len(saved_sym_nodes))
    check_no_random_op_redrawn(fw_module, bw_module)
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
    """A SymInt / SymFloat / SymBool value: saved apart from tensors, first (torch's rule)."""
    return _tp.is_sym_node(node)


def is_opaque_node(node: fx.Node) -> bool:
    """An opaque script object (torch.ScriptObject, effect token payloads): saved apart from
    tensors where this torch's extraction takes them; False on a torch without the notion."""
    fn = getattr(_tp, "is_opaque_node", None)
    return bool(fn(node)) if fn is not None else False


def can_replay_rng() -> bool:
    """Whether this torch can save a forward RNG state and replay it in the backward."""
    return hasattr(_tp, "functionalize_rng_ops")


def recomputed_random_ops(fw: fx.GraphModule, bw: fx.GraphModule) -> list[str]:
    """Seeded random ops present in both graphs: computed in the forward and again in the
    backward."""
    in_fw = {n.name for n in fw.graph.nodes if op_classes.draws_randomness(n)}
    return [n.name for n in bw.graph.nodes
            if op_classes.draws_randomness(n) and n.name in in_fw]


def check_no_random_op_redrawn(fw: fx.GraphModule, bw: fx.GraphModule) -> None:
    """After RNG replay, no random op may run in both graphs as a plain op: it would draw
    anew in the backward and the gradient would be silently wrong."""
    redrawn = recomputed_random_ops(fw, bw)
    if redrawn:
        raise RuntimeError(
            f"deepcompile_remat: internal error: random ops {redrawn} are recomputed in the "
            "backward without replaying the forward's RNG state; the gradient would use other "
            "random numbers than the forward. Please report this with the graph.")
