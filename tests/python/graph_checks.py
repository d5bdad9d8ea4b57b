"""Checks on partitioned graphs that do not trust the partitioner's own bookkeeping.

`capture_partitions()` records the (forward, backward) modules every partition returns, for
both backends; `parameter_copies_saved()` then walks each saved value back through views, casts
and gathers with its own op list, so a leak the C++ marking misses cannot hide behind the
marking's own report.
"""
import contextlib
import operator

import torch
import torch.distributed as dist
import torch.fx as fx

from deepcompile_remat.partition.op_classes import GATHER_NAMESPACES

_CASTS = {"_to_copy", "to", "convert_element_type", "_autocast_to_reduced_precision",
          "_autocast_to_full_precision", "clone", "contiguous"}


def _is_gather(node: fx.Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and t.namespace in GATHER_NAMESPACES


def _alias_step(node: fx.Node):
    """(the input `node` derives from as a view, cast, copy, gather or getitem; whether that
    step passes through a gather), or (None, False). An element of a bucketed gather steps to
    its own shard."""
    if node.op != "call_function":
        return None, False
    t = node.target
    if t is operator.getitem:
        src, k = node.args[0], node.args[1]
        if isinstance(src, fx.Node) and _is_gather(src) and isinstance(src.args[0], (list, tuple)):
            return src.args[0][k], True  # bucket -> getitem k -> the k-th shard
        return src, False
    if isinstance(t, torch._ops.OpOverload):
        if _is_gather(node) or t.is_view or t.overloadpacket.__name__ in _CASTS:
            first = node.args[0]
            if isinstance(first, (list, tuple)):  # a bucket used whole: no single source
                return None, False
            return (first, _is_gather(node)) if isinstance(first, fx.Node) else (None, False)
    return None, False


def saved_names(bw: fx.GraphModule) -> list[str]:
    return [n.name for n in bw.graph.nodes
            if n.op == "placeholder" and not n.name.startswith(("tangents", "bwd_seed",
                                                                 "bwd_base_offset"))]


def saved_tensor_pairs(fw: fx.GraphModule, bw: fx.GraphModule) -> list[tuple[str, fx.Node]]:
    """(backward placeholder name, the forward node it receives) for each saved tensor, by
    AOTAutograd's calling convention: the forward returns (outputs, saved tensors, other
    saved objects) and the backward takes (saved SymInts, saved tensors, ...) with the saved
    tensors in the same order. Names are not used: passes after the cut (the re-gather
    schedule's buckets) rename forward nodes."""
    by_name = {n.name: n for n in bw.graph.nodes}
    saved = [by_name[name] for name in saved_names(bw)]
    tensors = [n.name for n in saved if isinstance(n.meta.get("val"), torch.Tensor)]
    out = fw.graph.find_nodes(op="output")[0]
    returned = list(out.args[0])
    num_fwd_outputs = len(returned) - len(saved)
    return list(zip(tensors, returned[num_fwd_outputs:num_fwd_outputs + len(tensors)]))


def parameter_copies_saved(fw: fx.GraphModule, bw: fx.GraphModule,
                           parameter_names=()) -> list[str]:
    """Saved values that are a gathered, viewed, cast or copied parameter (not the parameter
    itself): a chain of alias steps from the saved node that passes through a gather, or ends
    at one of `parameter_names` (forward placeholders)."""
    leaks = []
    for name, node in saved_tensor_pairs(fw, bw):
        steps, gathered = 0, False
        while node is not None:
            prev, through_gather = _alias_step(node)
            if prev is None:
                break
            gathered |= through_gather
            node, steps = prev, steps + 1
        if steps and (gathered or (node is not None and node.op == "placeholder"
                                   and node.name in parameter_names)):
            leaks.append(name)
    return leaks


@contextlib.contextmanager
def capture_partitions():
    """Yields a list that fills with (fw, bw, parameter_names) for every partition made inside
    the block; parameter_names are the forward placeholders of the primals the backend passed
    as parameters (nn.Parameter inputs), in the order of the joint graph's primals."""
    from deepcompile_remat.partition import cut
    from deepcompile_remat.planning import partition_fn

    seen, original = [], partition_fn.partition_joint_graph

    def recording(joint_module, *args, **kwargs):
        primals = [n.name for n in joint_module.graph.nodes
                   if n.op == "placeholder" and n.name.startswith("primals")]
        indices = cut.resolve_parameter_indices(
            joint_module, kwargs["config"], kwargs.get("parameter_indices"),
            kwargs.get("num_graph_inputs"), kwargs.get("static_lifetime_input_indices"))
        if indices is None:
            indices = kwargs.get("static_lifetime_input_indices") or ()
        fw, bw = original(joint_module, *args, **kwargs)
        seen.append((fw, bw, {primals[i] for i in indices}))
        return fw, bw

    partition_fn.partition_joint_graph = recording
    try:
        yield seen
    finally:
        partition_fn.partition_joint_graph = original


def assert_same_decision_on_every_rank(world: int) -> None:
    """Every partition in dcr.reports() made the same decision on each of the `world` ranks:
    the saved values (with their symbolic bytes, where a size is dynamic), the recomputed ops,
    the collectives and the runtime's schedule."""
    import deepcompile_remat as dcr

    decisions = [(tuple((v.name, v.bytes_symbolic) for v in r.saved), r.recomputed,
                  r.collectives, r.schedule) for r in dcr.reports()]
    every_rank = [None] * world
    dist.all_gather_object(every_rank, decisions)
    assert all(d == every_rank[0] for d in every_rank), "ranks costed or cut differently"


def assert_one_cut_on_every_rank(world: int) -> None:
    """Every partition in dcr.reports() saved and recomputed the same values and issues the same
    collectives on each of the `world` ranks, and every one whose collectives span ranks was
    agreed (planning/agreement.py) on one rank's cut: for graphs static at each rank's own
    size, where the schedule's simulated peaks differ and assert_same_decision_on_every_rank
    does not apply."""
    import deepcompile_remat as dcr

    decisions = [(tuple(v.name for v in r.saved), r.recomputed, r.collectives, r.cut_by_rank)
                 for r in dcr.reports()]
    every_rank = [None] * world
    dist.all_gather_object(every_rank, decisions)
    assert all(d == every_rank[0] for d in every_rank), every_rank
    assert all(by is not None for *_, collectives, by in every_rank[0] if collectives)


def _start_wait_ops() -> dict:
    """Each async start op of the runtime -> its wait op."""
    dcr = torch.ops.dcr
    return {dcr.allgather_cast_start.default: dcr.allgather_cast_wait.default,
            dcr.allgather_cast_bucket_start.default: dcr.allgather_cast_bucket_wait.default,
            dcr.reduce_scatter_grad_start.default: dcr.reduce_scatter_grad_wait.default,
            dcr.reduce_scatter_grad_bucket_start.default:
                dcr.reduce_scatter_grad_bucket_wait.default}


def reads_before_wait(gm: fx.GraphModule) -> list:
    """Where a collective's result is read before the collective completed: each start
    (dcr::allgather_cast_start, _bucket_start, dcr::reduce_scatter_grad_start, _bucket_start)
    must have exactly one wait of its kind, reached from the start directly or through the
    getitems of its outputs; every other reader of the start's result (through getitems too)
    must come after that wait in graph order (its readers' readers then do too). A start
    without its wait would leave a collective in flight past the graph. Returns the
    violations."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    bad = []
    for start in [n for n in gm.graph.nodes if n.target in _start_wait_ops()]:
        wait_op = _start_wait_ops()[start.target]
        results = [start] + [u for u in start.users if u.target is operator.getitem]
        readers = {u for r in results for u in r.users if u.target is not operator.getitem}
        waits = [u for u in readers if u.target is wait_op]
        if len(waits) != 1:
            bad.append(f"{start.name} has {len(waits)} waits")
            continue
        bad += [f"{u.name} reads {start.name} before {waits[0].name}" for u in readers
                if u is not waits[0] and position[u] < position[waits[0]]]
    return bad

