"""bench-partition: our partition_fn against torch's min_cut_rematerialization_partition.

Joint graphs of GPT-style models (2 to 48 layers) are captured once through torch.compile
with AOTAutograd; each partitioner then gets its own deep copy of the same joint graph, so
both solve identical inputs in one run. Reported per model: graph nodes, wall time of each
partition call, saved bytes (all saved tensors, and those that are not parameters), and the
number of compute-intensive forward ops each recomputes in the backward.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import asdict, dataclass

NAME = "bench-partition"
DEFAULT_LAYERS = (2, 8, 24, 48)


@dataclass
class JointCapture:
    """One joint graph as AOTAutograd handed it to the partitioner, with the arguments both
    partitioners are called with."""
    joint: object  # fx.GraphModule
    num_fwd_outputs: int
    static_lifetime_input_indices: list


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


def capture_joint_graph(layers: int, *, d_model: int, seq: int, autocast: bool) -> JointCapture:
    """The joint forward/backward graph of a `layers`-deep GPT, captured once through
    torch.compile with AOTAutograd (under CPU bf16 autocast when `autocast`)."""
    import torch
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition

    from deepcompile_remat.harness.models import GPT

    model = GPT(vocab=256, d=d_model, layers=layers, heads=4, max_t=seq)
    captured = []

    def capture(joint, joint_inputs, *, num_fwd_outputs, static_lifetime_input_indices=None,
                **kw):
        captured.append(JointCapture(copy.deepcopy(joint), num_fwd_outputs,
                                     list(static_lifetime_input_indices or ())))
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                 static_lifetime_input_indices=static_lifetime_input_indices, **kw)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=lambda gm, _: gm, partition_fn=capture)
    idx = torch.randint(0, 256, (2, seq))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        torch.compile(model, backend=backend, fullgraph=True)(idx)
    torch._dynamo.reset()
    return captured[0]


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
    from deepcompile_remat.partition import build_partition_fn
    from deepcompile_remat.partition.fx_export import is_primal

    cap = capture_joint_graph(layers, d_model=d_model, seq=seq, autocast=autocast)
    nodes = sum(1 for n in cap.joint.graph.nodes if n.op != "output")
    primals = [n.name for n in cap.joint.graph.nodes if is_primal(n)]
    params = {primals[i] for i in cap.static_lifetime_input_indices}
    kwargs = dict(num_fwd_outputs=cap.num_fwd_outputs,
                  static_lifetime_input_indices=cap.static_lifetime_input_indices)

    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    from deepcompile_remat.partition import reports

    ours_fn = build_partition_fn(RematConfig(policy=policy))
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds bench-partition's flags (depths, model size, policy, autocast) to `parser`."""
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    parser.add_argument("--layers", type=int, nargs="+", default=list(DEFAULT_LAYERS),
                        help=f"GPT depths to capture (default {' '.join(map(str, DEFAULT_LAYERS))})")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--policy", choices=("conservative", "aggressive"), default="conservative")
    parser.add_argument("--autocast", action="store_true", help="capture under CPU bf16 autocast")


def format_table(rows: list[PartitionRow]) -> str:
    """The rows as a fixed-width text table, one line per model depth."""
    head = (f"{'layers':>6} {'nodes':>7} {'ours ms':>9} {'torch ms':>10} {'speedup':>8} "
            f"{'decide ours':>12} {'decide torch':>13} {'speedup':>8} "
            f"{'ours saved MB':>14} {'torch saved MB':>15} {'ours act MB':>12} "
            f"{'torch act MB':>13} {'CI recomp ours/torch':>21}")
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.layers:>6} {r.nodes:>7} {r.ours_ms:>9.1f} {r.torch_ms:>10.1f} {r.speedup:>7.1f}x "
            f"{r.ours_decide_ms:>12.1f} {r.torch_decide_ms:>13.1f} {r.decide_speedup:>7.1f}x "
            f"{r.ours_saved_bytes / 2**20:>14.2f} {r.torch_saved_bytes / 2**20:>15.2f} "
            f"{r.ours_activation_bytes / 2**20:>12.2f} {r.torch_activation_bytes / 2**20:>13.2f} "
            f"{r.ours_recomputed_compute_intensive:>10}/{r.torch_recomputed_compute_intensive:<10}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Time our partition_fn against torch's min-cut partitioner on GPT joint graphs."""
    # Warm-up: first calls pay imports and op-table construction; time neither of those.
    bench_one(1, d_model=args.d_model, seq=args.seq, autocast=args.autocast, policy=args.policy)
    rows = []
    for layers in args.layers:
        rows.append(bench_one(layers, d_model=args.d_model, seq=args.seq,
                              autocast=args.autocast, policy=args.policy))
        if not args.json:
            print(format_table(rows[-1:]).splitlines()[-1] if len(rows) > 1 else format_table(rows),
                  flush=True)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    return 0
