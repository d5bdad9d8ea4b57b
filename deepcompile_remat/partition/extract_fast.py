"""Builds the forward and backward GraphModules straight from the cut, in one pass each.

The modules are the ones torch's path builds (``_extract_fwd_bwd_modules``, then
``reordering_to_mimic_autograd_engine`` and ``raise_getitems`` on them): the same
placeholders, nodes, node order, names and outputs. What differs is the cost. torch builds
each graph by copying every node it can compute and then deleting the dead ones, three
graphs in all, then copies the backward once more to reorder it and generates its Python
code twice; this module decides each graph's node set and final order on the joint graph
first (index arithmetic) and copies each kept node exactly once. Both modules are lazy
(code is generated on first call).

AOTAutograd's calling convention, as torch 2.13 lays it out:
  forward  inputs:  primals, forward RNG seed/offset
           outputs: user outputs, saved tensors (those checked for in-place changes first,
                    then those marked saved_tensor_with_no_vc_check), saved SymInts (the
                    symbols that bind the sizes of everything the backward takes first)
  backward inputs:  saved SymInts, saved tensors, tangents, backward RNG seed/offset
           outputs: the joint graph's gradient outputs
A saved value the backward does not use is dropped from both (and from the caller's lists).

Node placement follows torch's rules: a node is in a graph when all its inputs are; a node
that must be in the backward (a mutation tagged there, or a must_be_in_backward tag) is
never in the forward, and the converse; a graph keeps what its outputs need plus every
side-effectful node it can compute (FX's dead-code rule). The backward then runs in the
order the autograd engine would: from the first node that reads a tangent, each node is
preceded by the recomputed forward nodes it needs that are not yet computed, in joint
order; recomputed nodes nothing after that point needs are dropped. Getitems come right
after the node whose tuple they read.

What this module does not do, and ``unsupported_reason`` sends to torch's path instead:
opaque objects and BackwardState among the values, call_module/call_method nodes,
invoke_subgraph (its RNG threading), activation quantization, an older torch whose
output descriptors differ. While building it raises ``Unsupported`` for the rarer cases:
a seeded random op computed in both graphs (its RNG state must be replayed:
functionalize_rng_ops), a forward output that depends on the backward, a getitem that
reads several nodes. It never mutates the joint graph or the caller's lists before it
has succeeded, so the fallback starts from the same state.

Cost: O(nodes + edges) to place and order (sorting the few recomputed nodes inserted at
once), plus one node copy per node of each graph.
"""
from __future__ import annotations

import copy
import functools
import inspect
import operator
from typing import Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._functorch import partitioners as _tp

from deepcompile_remat.partition import op_classes
from deepcompile_remat.partition.dce import ImpureNodes

FORWARD, BACKWARD = "forward", "backward"


# torch's own predicates we apply, so that inputs and placement mean what they mean there
_TORCH_RULES = ("_is_primal", "_is_tangent", "_is_fwd_seed_offset", "_is_bwd_seed_offset",
                "_must_be_in_backward", "_must_be_in_forward")


class Unsupported(Exception):
    """This joint graph needs torch's extraction (the message says why)."""


@functools.lru_cache(maxsize=1)
def _descriptor_types():
    try:
        from torch._functorch._aot_autograd import descriptors
    except ImportError:
        return None, None
    return (getattr(descriptors, "SavedForBackwardsAOTOutput", None),
            getattr(descriptors, "SavedForBackwardsNoVcCheckAOTOutput", None))


@functools.lru_cache(maxsize=1)
def torch_helper_params() -> frozenset:
    """The parameter names of this torch's ``_extract_fwd_bwd_modules`` (they differ across
    releases: callers bind by keyword)."""
    return frozenset(inspect.signature(_tp._extract_fwd_bwd_modules).parameters)


@functools.lru_cache(maxsize=1)
def _opaque_object_types() -> tuple:
    kinds = []
    try:
        from torch._library.fake_class_registry import FakeScriptObject
        kinds.append(FakeScriptObject)
    except ImportError:
        pass
    try:
        from torch.fx.experimental._backward_state import BackwardState
        kinds.append(BackwardState)
    except ImportError:
        pass
    return tuple(kinds)


def torch_layout_supported() -> bool:
    """This torch's extraction lays out saved values the way ours reproduces (saved-value
    descriptors, the helper's parameters, its rules): true on torch 2.13, false on 2.11, where
    every graph takes torch's path."""
    saved_type, _ = _descriptor_types()
    return (saved_type is not None
            and {"saved_opaque_nodes", "static_lifetime_input_nodes"} <= torch_helper_params()
            and all(hasattr(_tp, name) for name in _TORCH_RULES))


def unsupported_reason(joint_module: fx.GraphModule, saved_values, saved_sym_nodes,
                       saved_opaque_nodes) -> Optional[str]:
    """Why this joint graph must go through torch's extraction; None where ours builds the
    same modules. Cheap: one look at the saved values and the graph's node-kind tables."""
    if saved_opaque_nodes:
        return "opaque objects are saved"
    if not torch_layout_supported():
        return "this torch lays out saved values differently"
    graph = joint_module.graph
    if graph.find_nodes(op="call_module") or graph.find_nodes(op="call_method"):
        return "the joint graph calls modules or methods"
    invoke_subgraph = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    if invoke_subgraph is not None and graph.find_nodes(op="call_function",
                                                        target=invoke_subgraph):
        return "invoke_subgraph (its RNG states are threaded through by torch)"
    fusion_options = getattr(torch._inductor.config, "post_grad_fusion_options", None) or {}
    if fusion_options.get("activation_quantization_aten_pass") is not None:
        return "activation quantization is on"
    kinds = _opaque_object_types()
    if kinds:
        for n in graph.find_nodes(op="placeholder"):
            if isinstance(n.meta.get("val"), kinds):
                return "an opaque object or BackwardState is a graph input"
        for n in saved_values:
            if isinstance(n.meta.get("val"), kinds):
                return "an opaque object is saved"
    return None


@functools.lru_cache(maxsize=None)
def _is_mutable_op(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


class _Joint:
    """The facts of the joint graph both extractions read, computed once."""

    def __init__(self, joint_module: fx.GraphModule, num_fwd_outputs: int):
        graph = joint_module.graph
        self.nodes = [n for n in graph.nodes if n.op != "output"]
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.output = graph.find_nodes(op="output")[0]
        leaves = pytree.arg_tree_leaves(*self.output.args)
        descs = pytree.arg_tree_leaves(self.output.meta.get("desc", [None] * len(leaves)))
        self.fwd_outputs, self.bwd_outputs = leaves[:num_fwd_outputs], leaves[num_fwd_outputs:]
        self.fwd_descs, self.bwd_descs = descs[:num_fwd_outputs], descs[num_fwd_outputs:]
        placeholders = graph.find_nodes(op="placeholder")
        self.primals = [n for n in placeholders if _tp._is_primal(n)]
        self.tangents = [n for n in placeholders if _tp._is_tangent(n)]
        self.fwd_seeds = [n for n in placeholders if _tp._is_fwd_seed_offset(n)]
        self.bwd_seeds = [n for n in placeholders if _tp._is_bwd_seed_offset(n)]
        # Placement rules: only tagged or mutating nodes can be bound to one side.
        self.only_backward, self.only_forward = set(), set()
        for n in self.nodes:
            if "partitioner_tag" in n.meta or _is_mutable_op(n.target):
                if _tp._must_be_in_backward(n):
                    self.only_backward.add(n)
                if _tp._must_be_in_forward(n):
                    self.only_forward.add(n)
        self.impure = ImpureNodes()  # FX's dead-code rule: kept although unused

    def subgraph(self, inputs: list, outputs: list, side: str) -> set:
        """The joint nodes (not inputs) a graph with these inputs computes and keeps."""
        inputs_set = set(inputs)
        banned = self.only_backward if side == FORWARD else self.only_forward
        valid = set(inputs_set)
        candidates = []
        for n in self.nodes:
            if n in inputs_set or n.op == "placeholder" or n in banned:
                continue
            if n.op == "call_function":
                if all(a in valid for a in n.all_input_nodes):
                    valid.add(n)
                    candidates.append(n)
            elif n.op == "get_attr":
                valid.add(n)
                candidates.append(n)
            else:
                raise Unsupported(f"node kind {n.op}")
        kept: set = set()
        stack = []
        for x in outputs:
            if isinstance(x, fx.Node):
                if x not in valid:
                    raise Unsupported(f"{side} output {x.name} depends on the other graph")
                stack.append(x)
        stack.extend(n for n in candidates if n.op == "call_function" and self.impure(n))
        while stack:
            n = stack.pop()
            if n in kept or n in inputs_set:
                continue
            kept.add(n)
            stack.extend(n.all_input_nodes)
        return kept


def _raise_getitems(order: list) -> list:
    """The order after moving each getitem right after the node it reads, in reverse order
    of appearance (so getitems of one node keep their relative order)."""
    getitems = [n for n in order if n.op == "call_function" and n.target is operator.getitem]
    if not getitems:
        return order
    nxt = {a: b for a, b in zip(order, order[1:])}
    prv = {b: a for a, b in zip(order, order[1:])}
    head = order[0]
    for g in reversed(getitems):
        parents = g.all_input_nodes
        if len(parents) != 1:
            raise Unsupported(f"getitem {g.name} reads {len(parents)} nodes")
        parent = parents[0]
        if nxt.get(parent) is g:
            continue
        p, q = prv.get(g), nxt.get(g)  # unlink g
        if p is None:
            head = q
        else:
            nxt[p] = q
        if q is not None:
            prv[q] = p
        q = nxt.get(parent)  # insert after parent
        nxt[parent], prv[g] = g, parent
        nxt[g] = q
        if q is not None:
            prv[q] = g
        else:
            nxt.pop(g, None)
    out, n = [], head
    while n is not None:
        out.append(n)
        n = nxt.get(n)
    return out


def _autograd_order(joint: _Joint, inputs: list, kept: set) -> list:
    """Backward node order as the autograd engine would run it (module docstring)."""
    index = joint.index
    end = len(joint.nodes)
    body = sorted(kept, key=index.__getitem__)
    first = None
    for t in joint.tangents:
        if t not in inputs:
            continue
        for u in t.users:
            at = end if u.op == "output" else (index[u] if u in kept else None)
            if at is not None and (first is None or at < first):
                first = at
    if first is None:  # no gradient reads a tangent: keep the extraction order
        return body
    done = set(inputs)
    order: list = []

    def emit(roots: list) -> None:
        """Appends the roots and the kept nodes they need that are not yet placed, in
        joint order."""
        pending, stack = [], list(roots)
        while stack:
            n = stack.pop()
            if n in done:
                continue
            done.add(n)
            pending.append(n)
            stack.extend(n.all_input_nodes)
        pending.sort(key=index.__getitem__)
        order.extend(pending)

    copy_ = torch.ops.aten.copy_.default
    for n in body:
        if index[n] >= first:
            break
        if n.op == "call_function" and n.target is copy_:  # mutations that read no tangent
            emit([n])
    for n in body:
        if index[n] >= first:
            emit([n])
    emit([x for x in joint.bwd_outputs if isinstance(x, fx.Node)])  # what the output reads
    return order


def _placeholder_name(graph: fx.Graph, name: str) -> str:
    """The name ``graph.placeholder(name)`` gives: the same string when it is already
    snake case (joint placeholders are), without FX's regex."""
    if name == name.lower() and not (name.startswith("__") and name.endswith("__")):
        return name
    return graph._target_to_str(name)


def _copy_node(graph: fx.Graph, n: fx.Node, lookup) -> fx.Node:
    """``graph.node_copy(n, lookup)`` at a third of its cost. torch 2.13's ``create_node``
    walks every argument with pytree to warn about raw SymInts (half of node_copy's time);
    these arguments come from a graph that was already checked, so the node is created
    without them and they are attached after. ``meta`` is set past ``Node.__setattr__``,
    whose lookup-table re-indexing only op and target need."""
    new = graph.create_node(n.op, n.target, name=n.name, type_expr=n.type)
    new._update_args_kwargs(fx.node.map_arg(n.args, lookup), fx.node.map_arg(n.kwargs, lookup))
    object.__setattr__(new, "meta", n.meta.copy())
    return new


def _build(joint_module: fx.GraphModule, inputs: list, order: list, outputs: list,
           descs: list, backward: bool) -> fx.GraphModule:
    """One lazy GraphModule: placeholders named after `inputs`, then `order` copied."""
    graph = fx.Graph()
    env: dict = {}
    for n in inputs:
        p = graph.create_node("placeholder", n.name, name=_placeholder_name(graph, n.name))
        # as torch's: forward placeholders share the joint node's meta; the backward's are
        # copies (its reordering copies every node once more)
        p.meta = copy.copy(n.meta) if backward else n.meta
        env[n] = p
    lookup = env.__getitem__
    for n in order:
        new = _copy_node(graph, n, lookup)
        if backward and n.op in ("call_function", "get_attr"):
            new.meta["autograd_backward"] = True
        env[n] = new
    values = tuple(env[x] if isinstance(x, fx.Node) else x for x in outputs)
    out = graph.output(values)
    out.meta["desc"] = descs
    out.meta["output_stack_traces"] = [v.meta.get("stack_trace") if isinstance(v, fx.Node)
                                       else None for v in values]
    return fx._lazy_graph_module._make_graph_module(joint_module, graph)


def _bind_symbols(joint_module, saved_values, saved_sym_nodes, tangents) -> list:
    """Saved SymInts with, first, the nodes that bind every size symbol the backward's
    inputs mention (AOTAutograd binds sizes from them)."""
    from torch.fx.experimental.symbolic_shapes import (
        find_symbol_binding_fx_nodes, free_symbols, is_symbol_binding_fx_node)

    bound, binding, derived = set(), [], []
    for n in saved_sym_nodes:
        s = is_symbol_binding_fx_node(n)
        if s:
            bound.add(s)
            binding.append(n)
        else:
            derived.append(n)
    bindings = None
    for n in (*derived, *saved_values, *tangents):
        if "val" not in n.meta:
            continue
        new = free_symbols(n.meta["val"]) - bound
        if not new:
            continue
        if bindings is None:
            bindings = find_symbol_binding_fx_nodes(joint_module.graph)
        for s in sorted(new, key=lambda s: s.name):
            if s in bindings:
                binding.append(bindings[s])
        bound |= new
    return binding + derived


def _unused_by(kept: set, outputs: set, inputs: list) -> set:
    """Inputs neither a kept node nor the output reads; or read only by dead wait_tensor
    calls (a saved collective result the backward never uses)."""
    wait = getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None)
    wait = getattr(wait, "default", None) if torch.distributed.is_available() else None

    def users(n: fx.Node) -> list:
        return [u for u in n.users if u in kept] + ([n] if n in outputs else [])

    unused = set()
    for n in inputs:
        readers = users(n)
        if not readers or (wait is not None and all(
                u is not n and u.target is wait and not users(u) for u in readers)):
            unused.add(n)
    return unused


def extract_modules(joint_module: fx.GraphModule, saved_values: list, saved_sym_nodes: list,
                    *, num_fwd_outputs: int,
                    times: Optional[dict] = None) -> tuple[fx.GraphModule, fx.GraphModule]:
    """(forward, backward) for these saved values; on success the two lists are rewritten
    to what the backward takes, in the forward's output order (as torch's helper does).
    Raises Unsupported, with nothing changed, where torch's path must do it. `times`, if
    given, receives seconds per phase (place, order, build)."""
    import time

    t0 = time.perf_counter()
    joint = _Joint(joint_module, num_fwd_outputs)
    saved_set = set(saved_values) | set(saved_sym_nodes)
    bw_inputs = [*saved_sym_nodes, *saved_values, *joint.tangents, *joint.bwd_seeds]
    kept_bw = joint.subgraph(bw_inputs, joint.bwd_outputs, BACKWARD)
    bw_output_nodes = {x for x in joint.bwd_outputs if isinstance(x, fx.Node)}
    unused = _unused_by(kept_bw, bw_output_nodes, [n for n in bw_inputs if n in saved_set])
    values = [n for n in saved_values if n not in unused]
    syms = [n for n in saved_sym_nodes if n not in unused]
    syms = _bind_symbols(joint_module, values, syms, joint.tangents)
    checked = [n for n in values if not n.meta.get("saved_tensor_with_no_vc_check", False)]
    unchecked = [n for n in values if n.meta.get("saved_tensor_with_no_vc_check", False)]
    values = checked + unchecked

    bw_inputs = [*syms, *values, *joint.tangents, *joint.bwd_seeds]
    if set(values) | set(syms) != saved_set:  # pruned, or symbols bound: another backward
        kept_bw = joint.subgraph(bw_inputs, joint.bwd_outputs, BACKWARD)
    fw_inputs = [*joint.primals, *joint.fwd_seeds]
    fw_outputs = [*joint.fwd_outputs, *values, *syms]
    kept_fw = joint.subgraph(fw_inputs, fw_outputs, FORWARD)
    redrawn = [n.name for n in kept_bw if n in kept_fw and op_classes.draws_randomness(n)]
    if redrawn:
        raise Unsupported(f"random ops {redrawn} run in both graphs: their RNG state must be "
                          "replayed (functionalize_rng_ops)")
    t1 = time.perf_counter()

    fw_order = _raise_getitems([*fw_inputs, *sorted(kept_fw, key=joint.index.__getitem__)])
    bw_order = _raise_getitems([*bw_inputs, *_autograd_order(joint, bw_inputs, kept_bw)])
    saved_type, unchecked_type = _descriptor_types()
    if unchecked and unchecked_type is None:
        raise Unsupported("tensors saved without version checks on a torch without their "
                          "descriptor")
    n_saved = len(values)
    saved_descs = [unchecked_type(i) if len(checked) <= i < n_saved else saved_type(i)
                   for i in range(n_saved + len(syms))]
    t2 = time.perf_counter()

    fw_inputs_set = set(fw_inputs)
    bw_inputs_set = set(bw_inputs)
    fw = _build(joint_module, fw_inputs, [n for n in fw_order if n not in fw_inputs_set],
                fw_outputs, [*joint.fwd_descs, *saved_descs], backward=False)
    bw = _build(joint_module, bw_inputs, [n for n in bw_order if n not in bw_inputs_set],
                joint.bwd_outputs, list(joint.bwd_descs), backward=True)
    saved_values[:] = values
    saved_sym_nodes[:] = syms
    if times is not None:
        times.update(place_s=t1 - t0, order_s=t2 - t1, build_s=time.perf_counter() - t2)
    return fw, bw
