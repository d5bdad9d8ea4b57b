"""bench-partition's depth sweep: one captured GPT joint graph per depth, partitioned by ours and
by torch's min-cut, each on its own deep copy; whole-call and decision-only times, saved bytes,
and compute-intensive ops recomputed (PartitionRow)."""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

from dcr_bench.bench.joint_capture import capture_joint_graph


@dataclass
class PartitionRow:
    """One model depth's result: both partitioners' wall times, decision times (ours: export +
    C++ solve; torch: classify + networkx), saved and activation bytes, and compute-intensive
    ops recomputed in the backward."""
    layers: int
    nodes: int
    ours_ms: float
    torch_ms: float
    speedup: float
    ours_decide_ms: float
    torch_decide_ms: float
    decide_speedup: float
    ours_saved_bytes: int
    torch_saved_bytes: int
    ours_activation_bytes: int
    torch_activation_bytes: int
    ours_recomputed_compute_intensive: int
    torch_recomputed_compute_intensive: int


def _saved_stats(fw_module, bw_module, num_fwd_outputs, param_names):
    """Saved tensors = forward outputs after the user outputs; bytes and recomputed ops."""
    import torch
    import torch.fx as fx

    from deepcompile_remat.partition.fx_export import value_bytes
    from deepcompile_remat.partition.op_classes import OpClass, classify

    out = fw_module.graph.find_nodes(op="output")[0]
    saved = [n for n in out.args[0][num_fwd_outputs:] if isinstance(n, fx.Node)]
    tensors = [n for n in saved if isinstance(n.meta.get("val"), torch.Tensor)]
    total = sum(int(value_bytes(n.meta["val"])) for n in tensors)
    activations = sum(int(value_bytes(n.meta["val"])) for n in tensors if n.name not in param_names)
    fw_ops = {n.name for n in fw_module.graph.nodes if n.op == "call_function"}
    recomputed_ci = sum(1 for n in bw_module.graph.nodes if n.op == "call_function"
                        and n.name in fw_ops and classify(n) == OpClass.COMPUTE_INTENSIVE)
    return total, activations, recomputed_ci


def bench_one(layers: int, *, d_model: int, seq: int, autocast: bool, policy: str) -> PartitionRow:
    """Partitions one captured joint graph with ours and with torch's min-cut partitioner, each
    on its own deep copy, and returns their times and results as a PartitionRow."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from deepcompile_remat.config import RematConfig
    from deepcompile_remat.planning import remat_partition_fn
    from deepcompile_remat.partition.fx_export import is_primal

    cap = capture_joint_graph(layers, d_model=d_model, seq=seq, autocast=autocast)
    nodes = sum(1 for n in cap.joint.graph.nodes if n.op != "output")
    primals = [n.name for n in cap.joint.graph.nodes if is_primal(n)]
    params = {primals[i] for i in cap.static_lifetime_input_indices}
    kwargs = dict(num_fwd_outputs=cap.num_fwd_outputs,
                  static_lifetime_input_indices=cap.static_lifetime_input_indices)

    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    from deepcompile_remat.partition import reports

    ours_fn = remat_partition_fn(RematConfig(policy=policy))
    joint = copy.deepcopy(cap.joint)
    t0 = time.perf_counter()
    fw, bw = ours_fn(joint, [], **kwargs)
    ours_s = time.perf_counter() - t0
    ours = _saved_stats(fw, bw, cap.num_fwd_outputs, params)

    rep = reports()[-1]
    ours_decide_s = rep.export_s + rep.solve_s

    joint = copy.deepcopy(cap.joint)
    with _use_lazy_graph_module(True):  # as inductor calls it, and as ours runs
        t0 = time.perf_counter()
        fw, bw = min_cut_rematerialization_partition(joint, [], compiler="inductor", **kwargs)
        torch_s = time.perf_counter() - t0
    theirs = _saved_stats(fw, bw, cap.num_fwd_outputs, params)
    torch_decide_s = torch_decision_seconds(copy.deepcopy(cap.joint), **kwargs)
    return PartitionRow(layers, nodes, ours_s * 1e3, torch_s * 1e3, torch_s / ours_s,
                        ours_decide_s * 1e3, torch_decide_s * 1e3, torch_decide_s / ours_decide_s,
                        ours[0], theirs[0], ours[1], theirs[1], ours[2], theirs[2])


def torch_decision_seconds(joint, *, num_fwd_outputs, static_lifetime_input_indices) -> float:
    """Time of torch's decision alone (classify nodes + networkx min cut), after the same
    preparation (DCE, CSE, tags) both partitioners do and before the module extraction both
    share; the counterpart of our export + C++ solve."""
    from torch._functorch import partitioners as tp
    from torch._functorch.compile_utils import fx_graph_cse

    joint.graph.eliminate_dead_code()
    joint.graph = fx_graph_cse(joint.graph)
    if tp.has_recomputable_ops(joint):
        joint = tp.cleanup_recompute_tags(joint, is_default_partition=False)
    tp.force_save_collectives(joint)
    tp.force_save_effectful_ops(joint)
    tp.force_save_bw_mutation_src(joint)
    t0 = time.perf_counter()
    info = tp.classify_nodes(joint, static_lifetime_input_indices, num_fwd_outputs)
    for node in reversed(joint.graph.nodes):  # torch's distance-to-backward weights
        if node.op == "output" or info.is_required_fw(node):
            node.dist_from_bw = int(1e9)
            for user in node.users:
                node.dist_from_bw = min(node.dist_from_bw, getattr(user, "dist_from_bw", 0) + 1)
        else:
            node.dist_from_bw = 0
    tp.choose_saved_values_set(joint.graph, info, memory_budget=1.0)
    return time.perf_counter() - t0
