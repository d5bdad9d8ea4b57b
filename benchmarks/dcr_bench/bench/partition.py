"""bench-partition: our partition_fn against torch's min_cut_rematerialization_partition.

Joint graphs are captured once through torch.compile with AOTAutograd; each partitioner then
gets its own deep copy of the same joint graph, so both solve identical inputs in one run.

Depth sweep (--layers, GPT 2 to 48 layers): per model, graph nodes, wall time of each
partition call, saved bytes (all saved tensors, and those that are not parameters), and the
number of compute-intensive forward ops each recomputes in the backward.

End-to-end speed (--graphs: the 24-layer GPT encoder, a 16-layer transformers Llama): medians
of --reps calls, alternated so load changes hit all alike, of torch's whole call, ours, and
ours "before" (FX's DCE, torch's fx_graph_cse and torch's extraction: the passes ours
replaced; remat_partition_fn(..., torch_passes=True)), with our phases (PartitionReport's
prepare / export / solve / extract, extract split into place / order / build) and the min-max
spread.

--compile-share: instead, the partitioner's share of a whole torch.compile (first forward +
backward less a warm step) on the eager and inductor backends, before and after.
"""
from __future__ import annotations

import argparse
import copy
import contextlib
import json
import statistics
import time
from dataclasses import asdict, dataclass

NAME = "bench-partition"
DEFAULT_LAYERS = (2, 8, 24, 48)
DEFAULT_REPS = 5


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


def capture_joint(fn, *inputs, autocast: bool = False) -> JointCapture:
    """The first joint forward/backward graph torch.compile's AOTAutograd builds for
    fn(*inputs) (under CPU bf16 autocast when `autocast`)."""
    import torch
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    captured = []

    def keep(joint, joint_inputs, *, num_fwd_outputs, static_lifetime_input_indices=None, **kw):
        with unset_fake_temporarily():  # module constants are real tensors: copy them as such
            captured.append(JointCapture(copy.deepcopy(joint), num_fwd_outputs,
                                         list(static_lifetime_input_indices or ())))
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                 static_lifetime_input_indices=static_lifetime_input_indices,
                                 **kw)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=lambda gm, _: gm, partition_fn=keep)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    torch._dynamo.reset()
    return captured[0]


def gpt_model(layers: int = 24, d_model: int = 256, seq: int = 64) -> tuple:
    """The depth sweep's GPT encoder (harness.models.GPT), seeded: (module, inputs)."""
    import torch

    from dcr_bench.harness.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab=256, d=d_model, layers=layers, heads=4, max_t=seq)
    return model, (torch.randint(0, 256, (2, seq)),)


def llama_model(layers: int = 16, hidden: int = 64, seq: int = 64, *, vocab: int = 128,
                heads: int = 4, batch: int = 2) -> tuple:
    """A transformers Llama with random weights (harness.models.build_hf; max(heads // 2, 1)
    key/value heads, no dropout), seeded: (a function returning its logits, inputs: `batch`
    sequences of `seq` token ids)."""
    import torch

    from dcr_bench.harness.models import build_hf

    torch.manual_seed(0)
    model = build_hf("llama", vocab=vocab, hidden=hidden, layers=layers, heads=heads,
                     kv_heads=max(heads // 2, 1), seq=seq, dropout=0.0)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    return (lambda x: model(input_ids=x).logits), (ids,)


# The end-to-end graphs: name -> (builder, its sizes at full scale, at --tiny scale).
SPEED_GRAPHS = {
    "gpt24": (gpt_model, dict(layers=24, d_model=256, seq=64), dict(layers=2, d_model=64, seq=16)),
    "llama16": (llama_model, dict(layers=16, hidden=64, seq=64), dict(layers=2, hidden=32, seq=16)),
}


def build_speed_model(name: str, tiny: bool = False) -> tuple:
    """(fn, inputs) of one of SPEED_GRAPHS, at its full sizes or its tiny ones."""
    builder, full, small = SPEED_GRAPHS[name]
    return builder(**(small if tiny else full))


def capture_joint_graph(layers: int, *, d_model: int, seq: int, autocast: bool) -> JointCapture:
    """The joint forward/backward graph of a `layers`-deep GPT, captured once through
    torch.compile with AOTAutograd (under CPU bf16 autocast when `autocast`)."""
    model, inputs = gpt_model(layers, d_model, seq)
    return capture_joint(model, *inputs, autocast=autocast)


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
    from deepcompile_remat.partition import remat_partition_fn
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


# --- end to end: torch's whole call, ours before and after ------------------------------------

@dataclass
class SpeedRow:
    """One partitioner on one graph: medians over the repetitions, milliseconds. Phases are
    ours (zero for torch's row); `vs_torch` is torch's median over this row's."""
    graph: str
    partitioner: str  # "torch", "ours before" (torch's DCE, CSE, extraction) or "ours"
    nodes: int
    ms: float
    vs_torch: float
    prepare_ms: float
    export_ms: float
    solve_ms: float
    extract_ms: float  # place + order + build + the hooks' passes (none here)
    place_ms: float
    order_ms: float
    build_ms: float
    extract_path: str  # "ours", "torch" (before), or "torch: <why ours stepped aside>"
    spread_ms: tuple  # (min, max)


def as_compile_calls_it() -> contextlib.ExitStack:
    """The context AOTAutograd calls a partitioner in: a tracing context (without one, FX's
    dead-code elimination keeps unused random ops, SDPA included, alive) and lazy modules."""
    from torch._guards import TracingContext, tracing
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    stack = contextlib.ExitStack()
    stack.enter_context(tracing(TracingContext(None)))
    stack.enter_context(_use_lazy_graph_module(True))
    return stack


class ExtractTimes:
    """Wraps extract.extract_fwd_bwd_modules while entered so that each call fills `last`
    with the path it took and our extraction's phases (place, order, build seconds)."""

    def __init__(self):
        from deepcompile_remat.partition import extract

        self.last: dict = {}
        self._extract = extract
        self._real = extract.extract_fwd_bwd_modules

    def __call__(self, *args, **kwargs):
        """Our extraction, timed into `last`."""
        self.last = {}
        return self._real(*args, times=self.last, **kwargs)

    def __enter__(self):
        self._extract.extract_fwd_bwd_modules = self
        return self

    def __exit__(self, *exc):
        self._extract.extract_fwd_bwd_modules = self._real


def time_torch(cap: JointCapture) -> float:
    """Seconds of one min_cut_rematerialization_partition call on a fresh copy."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    joint = copy.deepcopy(cap.joint)
    with as_compile_calls_it():
        t0 = time.perf_counter()
        min_cut_rematerialization_partition(
            joint, [], compiler="inductor", num_fwd_outputs=cap.num_fwd_outputs,
            static_lifetime_input_indices=cap.static_lifetime_input_indices)
        return time.perf_counter() - t0


def time_ours(cap: JointCapture, partition_fn) -> tuple[float, object, dict]:
    """Seconds of one call of our partition_fn on a fresh copy, its PartitionReport, and the
    extraction's path and phases."""
    from deepcompile_remat.partition import reports

    joint = copy.deepcopy(cap.joint)
    with as_compile_calls_it(), ExtractTimes() as times:
        t0 = time.perf_counter()
        partition_fn(joint, [], num_fwd_outputs=cap.num_fwd_outputs,
                     static_lifetime_input_indices=cap.static_lifetime_input_indices)
        seconds = time.perf_counter() - t0
    return seconds, reports()[-1], times.last or {"path": "torch"}


def measure_speed(name: str, cap: JointCapture, reps: int, policy: str) -> list[SpeedRow]:
    """torch, ours before and ours, alternated `reps` times after one untimed warm-up call
    each (imports, op tables, caches); one SpeedRow each."""
    from deepcompile_remat.config import RematConfig
    from deepcompile_remat.partition import remat_partition_fn

    # "before": the same cut with the passes ours replaced (torch's cleaning and extraction).
    ours_fn = {before: remat_partition_fn(RematConfig(policy=policy), torch_passes=before)
               for before in (True, False)}
    time_torch(cap), time_ours(cap, ours_fn[True]), time_ours(cap, ours_fn[False])
    torch_s, runs = [], {True: [], False: []}
    for _ in range(reps):
        torch_s.append(time_torch(cap))
        for before in (True, False):
            runs[before].append(time_ours(cap, ours_fn[before]))
    med, ms = statistics.median, 1e3
    nodes = sum(1 for n in cap.joint.graph.nodes if n.op != "output")
    spread = lambda xs: (round(min(xs) * ms, 1), round(max(xs) * ms, 1))  # noqa: E731
    rows = [SpeedRow(name, "torch", nodes, med(torch_s) * ms, 1.0, 0, 0, 0, 0, 0, 0, 0, "",
                     spread(torch_s))]
    for before in (True, False):
        secs = [r[0] for r in runs[before]]
        reps_ = [r[1] for r in runs[before]]
        phases = [r[2] for r in runs[before]]
        rows.append(SpeedRow(
            name, "ours before" if before else "ours", nodes, med(secs) * ms,
            med(torch_s) / med(secs),
            med(r.prepare_s for r in reps_) * ms, med(r.export_s for r in reps_) * ms,
            med(r.solve_s for r in reps_) * ms, med(r.extract_s for r in reps_) * ms,
            med(t.get("place_s", 0.0) for t in phases) * ms,
            med(t.get("order_s", 0.0) for t in phases) * ms,
            med(t.get("build_s", 0.0) for t in phases) * ms,
            phases[-1].get("path", "?"), spread(secs)))
    return rows


def format_speed(rows: list[SpeedRow]) -> str:
    """One line per graph and partitioner: median ms, torch's over it, our phases, spread."""
    lines = [f"{'graph':<8} {'partitioner':<12} {'nodes':>6} {'ms':>8} {'vs torch':>9} "
             f"{'prepare':>8} {'export':>7} {'solve':>6} {'extract':>8} "
             f"{'(place':>7} {'order':>6} {'build)':>7}  {'spread ms':<14} path"]
    for r in rows:
        split = (f"{r.place_ms:>7.1f} {r.order_ms:>6.1f} {r.build_ms:>7.1f}"
                 if r.extract_path == "ours" else f"{'':>7} {'':>6} {'':>7}")
        phases = (f"{r.prepare_ms:>8.1f} {r.export_ms:>7.1f} {r.solve_ms:>6.1f} "
                  f"{r.extract_ms:>8.1f} {split}"
                  if r.partitioner != "torch" else f"{'':>8} {'':>7} {'':>6} {'':>8} {split}")
        lines.append(f"{r.graph:<8} {r.partitioner:<12} {r.nodes:>6} {r.ms:>8.1f} "
                     f"{r.vs_torch:>8.2f}x {phases}  "
                     f"{f'{r.spread_ms[0]}-{r.spread_ms[1]}':<14} {r.extract_path}")
    return "\n".join(lines)


# --- the partitioner's share of a whole compile ----------------------------------------------

def compile_once(name: str, kind: str, *, before: bool, tiny: bool = False) -> dict:
    """One fresh torch.compile of SPEED_GRAPHS[name] on backends.backend(kind), FX
    graph and autograd caches off: milliseconds in our partitioner and in the whole compile
    (first step less a warm step), and the share."""
    import torch
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from deepcompile_remat.backends import backend
    from deepcompile_remat.partition import partitioner

    fn, inputs = build_speed_model(name, tiny)
    spent = []
    real = partitioner.partition_joint_graph

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **{**kwargs, "torch_passes": before})
        finally:
            spent.append(time.perf_counter() - t0)

    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(fx_graph_cache=False))
        stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
        partitioner.partition_joint_graph = timed  # remat_partition_fn's closure looks it up
        stack.callback(setattr, partitioner, "partition_joint_graph", real)
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend=backend(kind))
        steps = []
        for _ in range(2):
            t0 = time.perf_counter()
            compiled(*inputs).float().pow(2).mean().backward()
            steps.append(time.perf_counter() - t0)
        torch._dynamo.reset()
    compile_s = max(steps[0] - steps[1], 1e-9)
    return {"partition_ms": sum(spent) * 1e3, "compile_ms": compile_s * 1e3,
            "share": sum(spent) / compile_s}


def compile_share(name: str, kind: str, tiny: bool = False) -> dict:
    """The partitioner's share of compile time, before and after, each after an untimed
    compile that warms the kernel caches both then hit alike."""
    compile_once(name, kind, before=False, tiny=tiny)
    return {"graph": name, "backend": kind,
            "before": compile_once(name, kind, before=True, tiny=tiny),
            "after": compile_once(name, kind, before=False, tiny=tiny)}


def format_share(rows: list[dict]) -> str:
    """One line per graph and backend: partition ms / compile ms (share), before and after."""
    lines = [f"{'graph':<9} {'backend':<9} {'before: partition / compile':>30} "
             f"{'after: partition / compile':>30}"]
    for r in rows:
        cells = [f"{r[k]['partition_ms']:>8.0f} / {r[k]['compile_ms']:>7.0f} ms "
                 f"({r[k]['share']:>4.0%})" for k in ("before", "after")]
        lines.append(f"{r['graph']:<9} {r['backend']:<9} {cells[0]:>30} {cells[1]:>30}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds bench-partition's flags (depths, model size, policy, autocast; end-to-end graphs,
    repetitions, compile share) to `parser`."""
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--layers", type=int, nargs="*", default=list(DEFAULT_LAYERS),
                        help="GPT depths of the depth sweep (default "
                             f"{' '.join(map(str, DEFAULT_LAYERS))}; none: skip it)")
    parser.add_argument("--d-model", type=int, default=256, help="the depth sweep's width")
    parser.add_argument("--seq", type=int, default=64, help="the depth sweep's sequence")
    parser.add_argument("--policy", choices=("conservative", "aggressive"), default="conservative")
    parser.add_argument("--autocast", action="store_true",
                        help="capture the depth sweep under CPU bf16 autocast")
    parser.add_argument("--graphs", nargs="*", choices=list(SPEED_GRAPHS),
                        default=list(SPEED_GRAPHS),
                        help="end-to-end graphs: torch vs ours before vs ours, with our phases "
                             f"(default {' '.join(SPEED_GRAPHS)}; none: skip them)")
    parser.add_argument("--reps", type=int, default=DEFAULT_REPS,
                        help=f"end-to-end repetitions; medians are reported (default {DEFAULT_REPS})")
    parser.add_argument("--tiny", action="store_true",
                        help="end-to-end graphs at tiny sizes (2 layers; a smoke run)")
    parser.add_argument("--compile-share", nargs="+", choices=("eager", "inductor"),
                        help="instead: the partitioner's share of a whole torch.compile of the "
                             "--graphs models (first forward + backward less a warm step) on "
                             "these backends, before (torch's DCE, CSE and extraction) and after")


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
    """Depth sweep and end-to-end speed of our partition_fn against torch's min-cut
    partitioner (or, with --compile-share, the partitioner's share of compile time)."""
    if args.reps < 1:
        raise SystemExit("deepcompile-remat bench-partition: --reps must be at least 1")
    if args.compile_share:
        shares = [compile_share(name, kind, args.tiny)
                  for name in args.graphs for kind in args.compile_share]
        print(json.dumps(shares, indent=1) if args.json else format_share(shares), flush=True)
        return 0
    rows = []
    if args.layers:
        # Warm-up: first calls pay imports and op-table construction; time neither of those.
        bench_one(1, d_model=args.d_model, seq=args.seq, autocast=args.autocast,
                  policy=args.policy)
    for layers in args.layers:
        rows.append(bench_one(layers, d_model=args.d_model, seq=args.seq,
                              autocast=args.autocast, policy=args.policy))
        if not args.json:
            print(format_table(rows[-1:]).splitlines()[-1] if len(rows) > 1 else format_table(rows),
                  flush=True)
    speed = []
    for name in args.graphs:
        fn, inputs = build_speed_model(name, args.tiny)
        speed.extend(measure_speed(name, capture_joint(fn, *inputs), args.reps, args.policy))
    if args.json:
        print(json.dumps({"depth_sweep": [asdict(r) for r in rows],
                          "end_to_end": [asdict(r) for r in speed]}, indent=1))
    elif speed:
        print(("\n" if rows else "") + format_speed(speed), flush=True)
    return 0
