"""End-to-end partition speed: our partition_fn against torch's min_cut_rematerialization_partition.

    PYTHONPATH=. python3 benchmarks/partition_speed.py [--reps 5] [--graphs gpt24 llama16]
    PYTHONPATH=. python3 benchmarks/partition_speed.py --compile-share eager inductor

Captures the joint graph of (i) the 24-layer GPT encoder bench-partition uses (d_model 256,
seq 64) and (ii) a 16-layer transformers Llama (hidden 64, random weights) once each, then
times both partitioners on fresh deep copies of the same joint module, several repetitions,
and prints medians: torch ms, ours ms, the ratio, and our phases (PartitionReport's
prepare/export/solve/extract, with extract split into the module building and the hooks'
passes). Medians because the machine may be shared: the min-max spread is printed beside them.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class Capture:
    """One joint graph as AOTAutograd hands it to a partition function."""
    joint: object  # fx.GraphModule
    num_fwd_outputs: int
    static_lifetime_input_indices: list


@dataclass
class SpeedRow:
    """Medians over the repetitions, milliseconds."""
    graph: str
    nodes: int
    torch_ms: float
    ours_ms: float
    ratio: float
    prepare_ms: float
    export_ms: float
    solve_ms: float
    extract_ms: float  # place + order + build + the hooks' passes (none here)
    place_ms: float
    order_ms: float
    build_ms: float
    extract_path: str  # "ours", or "torch: <why>"
    torch_spread_ms: tuple
    ours_spread_ms: tuple


def capture_joint(fn, *inputs) -> Capture:
    """The first joint graph torch.compile's AOTAutograd builds for fn(*inputs)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition

    captured = []

    def keep(joint, joint_inputs, *, num_fwd_outputs, static_lifetime_input_indices=None, **kw):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # module constants are real tensors: copy them as such
            captured.append(Capture(copy.deepcopy(joint), num_fwd_outputs,
                                    list(static_lifetime_input_indices or ())))
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                 static_lifetime_input_indices=static_lifetime_input_indices,
                                 **kw)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=lambda gm, _: gm, partition_fn=keep)
    torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    torch._dynamo.reset()
    return captured[0]


def gpt_model(layers: int = 24, d_model: int = 256, seq: int = 64) -> tuple:
    """bench-partition's GPT encoder (deepcompile_remat.bench.models.GPT): (fn, inputs)."""
    from deepcompile_remat.bench.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab=256, d=d_model, layers=layers, heads=4, max_t=seq)
    return model, (torch.randint(0, 256, (2, seq)),)


def llama_model(layers: int = 16, hidden: int = 64, seq: int = 64) -> tuple:
    """A transformers LlamaForCausalLM with random weights, built as the project builds HF
    models: (fn, inputs)."""
    from deepcompile_remat.bench import hf_models

    torch.manual_seed(0)
    model = hf_models.build("llama", layers=layers, hidden=hidden, seq=seq)
    ids = torch.randint(0, hf_models.vocab_size(model), (2, seq))
    return (lambda x: model(input_ids=x).logits), (ids,)


MODELS = {"gpt24": gpt_model, "llama16": llama_model}


def capture(name: str) -> Capture:
    """The joint graph of one of MODELS."""
    fn, inputs = MODELS[name]()
    return capture_joint(fn, *inputs)


def as_compile_calls_it():
    """The context AOTAutograd calls a partitioner in: a tracing context (without one, FX's
    dead-code elimination keeps unused random ops, SDPA included, alive) and lazy modules."""
    import contextlib

    from torch._guards import TracingContext, tracing
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    stack = contextlib.ExitStack()
    stack.enter_context(tracing(TracingContext(None)))
    stack.enter_context(_use_lazy_graph_module(True))
    return stack


def time_torch(cap: Capture) -> float:
    """Seconds of one min_cut_rematerialization_partition call on a fresh copy."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    joint = copy.deepcopy(cap.joint)
    with as_compile_calls_it():
        t0 = time.perf_counter()
        min_cut_rematerialization_partition(
            joint, [], compiler="inductor", num_fwd_outputs=cap.num_fwd_outputs,
            static_lifetime_input_indices=cap.static_lifetime_input_indices)
        return time.perf_counter() - t0


class ExtractTimes:
    """Wraps extract.extract_fwd_bwd_modules so that each call fills `last` with the path it
    took and our extraction's phases (place, order, build seconds)."""

    def __init__(self):
        from deepcompile_remat.partition import extract

        self.last: dict = {}
        self._extract = extract
        self._real = extract.extract_fwd_bwd_modules

    def __call__(self, *args, **kwargs):
        self.last = {}
        return self._real(*args, times=self.last, **kwargs)

    def __enter__(self):
        self._extract.extract_fwd_bwd_modules = self
        return self

    def __exit__(self, *exc):
        self._extract.extract_fwd_bwd_modules = self._real


def time_ours(cap: Capture, partition_fn) -> tuple[float, object, dict]:
    """Seconds of one call of our partition_fn on a fresh copy, its PartitionReport and the
    extraction's path and phases."""
    from deepcompile_remat.partition import reports

    joint = copy.deepcopy(cap.joint)
    with as_compile_calls_it(), ExtractTimes() as times:
        t0 = time.perf_counter()
        partition_fn(joint, [], num_fwd_outputs=cap.num_fwd_outputs,
                     static_lifetime_input_indices=cap.static_lifetime_input_indices)
        return time.perf_counter() - t0, reports()[-1], times.last


def measure(name: str, cap: Capture, reps: int) -> SpeedRow:
    """Alternates torch and ours `reps` times (so load changes hit both alike); medians."""
    from deepcompile_remat.config import RematConfig
    from deepcompile_remat.partition import make_partition_fn

    ours_fn = make_partition_fn(RematConfig())
    time_torch(cap), time_ours(cap, ours_fn)  # warm-up: imports, op tables, caches
    torch_s, ours_s, reps_, phases = [], [], [], []
    for _ in range(reps):
        torch_s.append(time_torch(cap))
        s, rep, times = time_ours(cap, ours_fn)
        ours_s.append(s)
        reps_.append(rep)
        phases.append(times)
    med = statistics.median
    ms = 1e3
    return SpeedRow(
        graph=name, nodes=sum(1 for n in cap.joint.graph.nodes if n.op != "output"),
        torch_ms=med(torch_s) * ms, ours_ms=med(ours_s) * ms, ratio=med(torch_s) / med(ours_s),
        prepare_ms=med(r.prepare_s for r in reps_) * ms, export_ms=med(r.export_s for r in reps_) * ms,
        solve_ms=med(r.solve_s for r in reps_) * ms, extract_ms=med(r.extract_s for r in reps_) * ms,
        place_ms=med(t.get("place_s", 0.0) for t in phases) * ms,
        order_ms=med(t.get("order_s", 0.0) for t in phases) * ms,
        build_ms=med(t.get("build_s", 0.0) for t in phases) * ms,
        extract_path=phases[-1].get("path", "?"),
        torch_spread_ms=(round(min(torch_s) * ms, 1), round(max(torch_s) * ms, 1)),
        ours_spread_ms=(round(min(ours_s) * ms, 1), round(max(ours_s) * ms, 1)))


def _old_prepare_and_extract(stack) -> None:
    """Puts back, for the length of `stack`, the path this change replaced: FX's DCE,
    torch's fx_graph_cse (a new graph) and torch's extraction."""
    from torch._functorch.compile_utils import fx_graph_cse

    from deepcompile_remat.partition import cse, dce, extract_fast

    def torch_cse(graph):
        graph.owning_module.graph = fx_graph_cse(graph)

    for module, name, value in (
            (dce, "eliminate_dead_code", lambda gm: gm.graph.eliminate_dead_code()),
            (cse, "eliminate_common_subexpressions", torch_cse),
            (extract_fast, "unsupported_reason", lambda *a: "the old path")):
        real = getattr(module, name)
        setattr(module, name, value)
        stack.callback(setattr, module, name, real)


def _compile_once(name: str, kind: str, old: bool) -> dict:
    """One fresh torch.compile of MODELS[name] on dcr.backend(kind): seconds in our
    partitioner and in the whole compile (first step less a warm step)."""
    import contextlib

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    import deepcompile_remat as dcr
    from deepcompile_remat.partition import partitioner

    fn, inputs = MODELS[name]()
    spent = []
    real = partitioner.partition_joint_graph

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t0)

    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(fx_graph_cache=False))
        stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
        partitioner.partition_joint_graph = timed
        stack.callback(setattr, partitioner, "partition_joint_graph", real)
        if old:
            _old_prepare_and_extract(stack)
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend=dcr.backend(kind))
        steps = []
        for _ in range(2):
            t0 = time.perf_counter()
            compiled(*inputs).float().pow(2).mean().backward()
            steps.append(time.perf_counter() - t0)
        torch._dynamo.reset()
    compile_s = steps[0] - steps[1]
    return {"partition_ms": sum(spent) * 1e3, "compile_ms": compile_s * 1e3,
            "share": sum(spent) / compile_s}


def compile_share(name: str, kind: str) -> dict:
    """The partitioner's share of compile time, before and after, after an untimed compile
    that warms the kernel caches both then hit alike."""
    _compile_once(name, kind, old=False)
    return {"graph": name, "backend": kind, "before": _compile_once(name, kind, old=True),
            "after": _compile_once(name, kind, old=False)}


def format_share(rows: list[dict]) -> str:
    """One line per graph and backend: partition ms / compile ms (share), before and after."""
    lines = [f"{'graph':<9} {'backend':<9} {'before: partition / compile':>30} "
             f"{'after: partition / compile':>30}"]
    for r in rows:
        cells = [f"{r[k]['partition_ms']:>8.0f} / {r[k]['compile_ms']:>7.0f} ms "
                 f"({r[k]['share']:>4.0%})" for k in ("before", "after")]
        lines.append(f"{r['graph']:<9} {r['backend']:<9} {cells[0]:>30} {cells[1]:>30}")
    return "\n".join(lines)


def format_table(rows: list[SpeedRow]) -> str:
    """One line per graph: medians, ratio, our phases, and the min-max spread."""
    lines = [f"{'graph':<9} {'nodes':>6} {'torch ms':>9} {'ours ms':>8} {'ratio':>6} "
             f"{'prepare':>8} {'export':>7} {'solve':>6} {'extract':>8} "
             f"{'(place':>7} {'order':>6} {'build)':>7}  path  spread torch / ours"]
    for r in rows:
        lines.append(
            f"{r.graph:<9} {r.nodes:>6} {r.torch_ms:>9.1f} {r.ours_ms:>8.1f} {r.ratio:>5.1f}x "
            f"{r.prepare_ms:>8.1f} {r.export_ms:>7.1f} {r.solve_ms:>6.1f} {r.extract_ms:>8.1f} "
            f"{r.place_ms:>7.1f} {r.order_ms:>6.1f} {r.build_ms:>7.1f}  {r.extract_path}  "
            f"{r.torch_spread_ms[0]}-{r.torch_spread_ms[1]} / "
            f"{r.ours_spread_ms[0]}-{r.ours_spread_ms[1]}")
    return "\n".join(lines)


def main() -> int:
    """Parses the flags, captures each graph, prints the table (or JSON rows)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--compile-share", nargs="+", choices=("eager", "inductor"),
                        help="instead: the partitioner's share of a whole torch.compile "
                             "(first forward + backward, less a warm step), before (torch's "
                             "DCE, CSE and extraction) and after, on these backends")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.compile_share:
        rows = [compile_share(name, kind) for name in args.graphs for kind in args.compile_share]
        print(json.dumps(rows, indent=1) if args.json else format_share(rows))
        return 0
    rows = [measure(name, capture(name), args.reps) for name in args.graphs]
    print(json.dumps([asdict(r) for r in rows], indent=1) if args.json else format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
