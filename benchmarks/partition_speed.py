"""End-to-end partition speed: our partition_fn against torch's min_cut_rematerialization_partition.

    PYTHONPATH=. python3 benchmarks/partition_speed.py [--reps 5] [--graphs gpt24 llama16]

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
    extract_ms: float
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


def gpt_capture(layers: int = 24, d_model: int = 256, seq: int = 64) -> Capture:
    """bench-partition's GPT encoder (deepcompile_remat.bench.models.GPT)."""
    from deepcompile_remat.bench.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab=256, d=d_model, layers=layers, heads=4, max_t=seq)
    return capture_joint(model, torch.randint(0, 256, (2, seq)))


def llama_capture(layers: int = 16, hidden: int = 64, seq: int = 64) -> Capture:
    """A transformers LlamaForCausalLM with random weights, built as the project builds HF models."""
    from deepcompile_remat.bench import hf_models

    torch.manual_seed(0)
    model = hf_models.build("llama", layers=layers, hidden=hidden, seq=seq)
    ids = torch.randint(0, hf_models.vocab_size(model), (2, seq))
    return capture_joint(lambda x: model(input_ids=x).logits, ids)


GRAPHS = {"gpt24": gpt_capture, "llama16": llama_capture}


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


def time_ours(cap: Capture, partition_fn) -> tuple[float, object]:
    """Seconds of one call of our partition_fn on a fresh copy, and its PartitionReport."""
    from deepcompile_remat.partition import reports

    joint = copy.deepcopy(cap.joint)
    with as_compile_calls_it():
        t0 = time.perf_counter()
        partition_fn(joint, [], num_fwd_outputs=cap.num_fwd_outputs,
                     static_lifetime_input_indices=cap.static_lifetime_input_indices)
        return time.perf_counter() - t0, reports()[-1]


def measure(name: str, cap: Capture, reps: int) -> SpeedRow:
    """Alternates torch and ours `reps` times (so load changes hit both alike); medians."""
    from deepcompile_remat.config import RematConfig
    from deepcompile_remat.partition import make_partition_fn

    ours_fn = make_partition_fn(RematConfig())
    time_torch(cap), time_ours(cap, ours_fn)  # warm-up: imports, op tables, caches
    torch_s, ours_s, reps_ = [], [], []
    for _ in range(reps):
        torch_s.append(time_torch(cap))
        s, rep = time_ours(cap, ours_fn)
        ours_s.append(s)
        reps_.append(rep)
    med = statistics.median
    ms = 1e3
    return SpeedRow(
        graph=name, nodes=sum(1 for n in cap.joint.graph.nodes if n.op != "output"),
        torch_ms=med(torch_s) * ms, ours_ms=med(ours_s) * ms, ratio=med(torch_s) / med(ours_s),
        prepare_ms=med(r.prepare_s for r in reps_) * ms, export_ms=med(r.export_s for r in reps_) * ms,
        solve_ms=med(r.solve_s for r in reps_) * ms, extract_ms=med(r.extract_s for r in reps_) * ms,
        torch_spread_ms=(round(min(torch_s) * ms, 1), round(max(torch_s) * ms, 1)),
        ours_spread_ms=(round(min(ours_s) * ms, 1), round(max(ours_s) * ms, 1)))


def format_table(rows: list[SpeedRow]) -> str:
    """One line per graph: medians, ratio, our phases, and the min-max spread."""
    lines = [f"{'graph':<9} {'nodes':>6} {'torch ms':>9} {'ours ms':>8} {'ratio':>6} "
             f"{'prepare':>8} {'export':>7} {'solve':>6} {'extract':>8}  spread torch / ours"]
    for r in rows:
        lines.append(
            f"{r.graph:<9} {r.nodes:>6} {r.torch_ms:>9.1f} {r.ours_ms:>8.1f} {r.ratio:>5.1f}x "
            f"{r.prepare_ms:>8.1f} {r.export_ms:>7.1f} {r.solve_ms:>6.1f} {r.extract_ms:>8.1f}  "
            f"{r.torch_spread_ms[0]}-{r.torch_spread_ms[1]} / "
            f"{r.ours_spread_ms[0]}-{r.ours_spread_ms[1]}")
    return "\n".join(lines)


def main() -> int:
    """Parses the flags, captures each graph, prints the table (or JSON rows)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", nargs="+", choices=list(GRAPHS), default=list(GRAPHS))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(name, GRAPHS[name](), args.reps) for name in args.graphs]
    print(json.dumps([asdict(r) for r in rows], indent=1) if args.json else format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
