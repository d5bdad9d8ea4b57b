"""bench-budget: our memory-budget cut against torch's activation_memory_budget, side by side.

Each model's joint graph is captured once (AOTAutograd through torch.compile, as bench-partition
does); every partition below gets its own deep copy of it. For each budget b:

  torch   min_cut_rematerialization_partition under
          torch._functorch.config.patch(activation_memory_budget=b, ..._solver=S): a knapsack
          over the min-cut's banned nodes, b a fraction of [inputs only, default cut] bytes;
  ours    our partitioner with RematConfig(memory_budget=b): the parametric min-cut
          (partition/budget.py), b a fraction of our default cut's bytes (raised to our
          smallest cut: b = 0 is the least memory, as torch's);
  ours at torch's bytes
          our partitioner with torch's achieved bytes as an absolute budget: the fair check,
          since the two fractions have different bases.

Both sides are measured the same way, from the partitioned modules:
  saved bytes     the forward's outputs after the user outputs (the values handed to the
                  backward), 1x; parameters (static inputs) and views of them count 0;
  recompute cost  the backward's recomputed forward ops (a backward op named like a forward
                  op), each priced as our budget solver prices it: recompute_cost_of (a flops
                  estimate) for an op recomputed at a cost (matmuls, attention, other non-fusible
                  ops), 0 for an op both partitioners recompute freely (fusible pointwise ops,
                  views). One estimator for both sides. The count over every recomputed op, free
                  ones at one flop per output element, is kept as well (all_ops_flops).

Flags per row:
  worse on both               ours saves more AND recomputes more than torch (must not happen);
  ours@torch costs more       ours within torch's bytes recomputes more than torch: allowed by
                              our solver's contract only within its stated optimality gap
                              (budget_cut.h, "Choice"), and said so ("within our gap");
  torch recomputes ops we ban torch's cut recomputes what our constraints never recompute
                              (CPU flash attention is tagged random): a cut we may not take, so
                              it may lie below our hull;
  torch below our hull        otherwise torch found a cut our hull says cannot exist (a bug);
  measured != solver          our modules measure other bytes/cost than our solver reported;
  torch / ours non-monotone   a smaller budget that saves more bytes, or recomputes less, than
                              the next larger one.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

from dcr_bench.bench import joint_capture
from dcr_bench.bench.tables import format_table
from dcr_bench.harness.workload import Workload

NAME = "bench-budget"
MODELS = ("gpt", "llama")
SOLVERS = ("dp", "greedy", "ilp")
DEFAULT_BUDGETS = tuple(round(1.0 - i / 10, 1) for i in range(11))  # 1.0, 0.9, ..., 0.0
MB = 2**20
GFLOP = 1e9


# One captured graph's model sizes: the harness's Workload, small (the command runs in about a
# minute on a 2-core CPU).
SIZES = Workload(layers=4, hidden=256, heads=4, vocab=256, seq=64, batch=2)


@dataclass
class Measured:
    """What one partition hands to the backward and what the backward recomputes."""
    saved_bytes: float = math.nan
    recompute_flops: float = math.nan  # priced recomputed ops (module docstring)
    all_ops_flops: float = math.nan    # every recomputed op, free ones at their element count
    recomputed_ops: int = 0
    # Recomputed ops our constraints forbid recomputing (price +inf: random or effectful ops,
    # inputs): such a cut is outside the set our solver chooses from.
    recomputed_banned: tuple[str, ...] = ()
    infeasible_min_bytes: Optional[float] = None  # set: the budget is below our smallest cut

    @property
    def feasible(self) -> bool:
        """The budget admitted a cut (else infeasible_min_bytes names the smallest one)."""
        return self.infeasible_min_bytes is None


@dataclass
class BudgetRow:
    """One budget fraction on one graph: torch's cut, ours, ours at torch's bytes, and what
    our solver said of them."""
    budget: float
    torch: Measured
    ours: Measured
    ours_at_torch_bytes: Measured
    ours_solver_bytes: Optional[float] = None  # what our solver says it saves (BudgetSummary)
    ours_solver_flops: Optional[float] = None
    ours_at_torch_solver_bytes: Optional[float] = None
    ours_at_torch_solver_flops: Optional[float] = None
    # At torch's bytes: no cut within them recomputes less than hull_flops_at_torch_bytes (our
    # hull's lower bound), and ours is at most optimality_gap above it.
    hull_flops_at_torch_bytes: Optional[float] = None
    ours_at_torch_optimality_gap: Optional[float] = None
    flags: list[str] = field(default_factory=list)


@dataclass
class GraphResult:
    """Every budget on one captured graph, with both fractions' bases."""
    model: str
    sizes: Workload
    graph_nodes: int
    torch_solver: str
    torch_range_bytes: tuple[float, float]  # torch's fraction base: [inputs only, default]
    ours_default_bytes: float               # our fraction base: the default cut's bytes
    rows: list[BudgetRow]
    seconds: float


# --- capture -----------------------------------------------------------------------------------

def capture_llama(sizes: Workload) -> joint_capture.JointCapture:
    """The joint graph of a transformers Llama (random weights; logits as the output), captured
    as joint_capture.capture_joint_graph captures the built-in GPT's."""
    fn, inputs = joint_capture.llama_model(sizes.layers, sizes.hidden, sizes.seq,
                                           vocab=sizes.vocab, heads=sizes.heads,
                                           batch=sizes.batch)
    return joint_capture.capture_joint(fn, *inputs)


def capture(model: str, sizes: Workload) -> joint_capture.JointCapture:
    """The joint graph of `model` ("gpt": the built-in GPT, "llama": transformers' Llama)."""
    if model == "gpt":
        if (sizes.heads, sizes.batch, sizes.vocab) != (4, 2, 256):
            raise ValueError("the built-in GPT is captured with 4 heads, batch 2, vocab 256")
        return joint_capture.capture_joint_graph(sizes.layers, d_model=sizes.hidden,
                                                 seq=sizes.seq, autocast=False)
    if model == "llama":
        return capture_llama(sizes)
    raise ValueError(f"unknown model {model!r}; models: {list(MODELS)}")


# --- measurement -------------------------------------------------------------------------------

class Meter:
    """Measures partitioned modules of one captured joint graph (module docstring): the same
    rules for torch's modules and ours. Prices come from our budget solver over the joint
    graph as both partitioners see it (DCE'd and CSE'd; node names survive both)."""

    def __init__(self, cap: joint_capture.JointCapture, policy: str):
        from torch._functorch.compile_utils import fx_graph_cse

        from deepcompile_remat.partition import budget, fx_export

        joint = copy.deepcopy(cap.joint)
        with compiling(cap):  # the same dead-code elimination the partitioners see
            joint.graph.eliminate_dead_code()
            joint.graph = fx_graph_cse(joint.graph)
        joint.recompile()
        static = cap.static_lifetime_input_indices
        graph = fx_export.export_joint_graph(
            joint, num_fwd_outputs=cap.num_fwd_outputs, static_lifetime_input_indices=static,
            parameter_indices=static)
        sweep = budget.BudgetSweep(graph, policy=policy)
        price = sweep.recompute_price  # the per-node price the cut uses
        self.price = {n.name: float(p) for n, p in zip(graph.nodes, price)}
        self.num_fwd_outputs = cap.num_fwd_outputs
        primals = [n.name for n in cap.joint.graph.nodes if fx_export.is_primal(n)]
        self.static_names = {primals[i] for i in static}
        self.ours_default_bytes = sweep.default_saved_bytes()

    def _aliases_static_input(self, node) -> bool:
        """node is a static input, or a view / getitem chain over one: saving it costs nothing."""
        from deepcompile_remat.fx_values import storage_root

        root = storage_root(node)
        return root.op == "placeholder" and root.name in self.static_names

    def measure(self, fw, bw) -> Measured:
        """Saved bytes and recompute cost of one (forward, backward) pair."""
        import torch
        import torch.fx as fx

        from deepcompile_remat.partition.budget import recompute_cost_of
        from deepcompile_remat.partition.fx_export import value_bytes

        out = fw.graph.find_nodes(op="output")[0]
        saved = [n for n in out.args[0][self.num_fwd_outputs:] if isinstance(n, fx.Node)]
        nbytes = sum(value_bytes(n.meta["val"]) for n in saved
                     if isinstance(n.meta.get("val"), torch.Tensor)
                     and not self._aliases_static_input(n))
        fw_ops = {n.name for n in fw.graph.nodes if n.op == "call_function"}
        recomputed = [n for n in bw.graph.nodes if n.op == "call_function" and n.name in fw_ops]
        banned = tuple(n.name for n in recomputed
                       if not math.isfinite(self.price.get(n.name, math.inf)))
        # An op we would never recompute (or a name we do not know): count its estimate.
        priced = sum(recompute_cost_of(n) if n.name in banned else self.price[n.name]
                     for n in recomputed)
        every = sum(recompute_cost_of(n) for n in recomputed)
        return Measured(float(nbytes), float(priced), float(every), len(recomputed), banned)


@contextlib.contextmanager
def compiling(cap: joint_capture.JointCapture):
    """As inside torch.compile: a TracingContext over the graph's fake mode. Without one,
    FX's dead-code elimination keeps unused random ops (CPU flash attention is tagged
    nondeterministic_seeded), so a partitioned backward would keep a dead copy of them."""
    import torch

    vals = [n.meta.get("val") for n in cap.joint.graph.find_nodes(op="placeholder")]
    fake_mode = torch._guards.detect_fake_mode(vals)
    with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
        yield


def run_torch(cap: joint_capture.JointCapture, budget: float, solver: str):
    """torch's partitioner at activation_memory_budget=budget, on a copy of the joint graph."""
    from torch._functorch import config as functorch_config
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    with functorch_config.patch(activation_memory_budget=budget,
                                activation_memory_budget_solver=solver), \
            _use_lazy_graph_module(True), compiling(cap):
        return min_cut_rematerialization_partition(
            copy.deepcopy(cap.joint), [], compiler="inductor", num_fwd_outputs=cap.num_fwd_outputs,
            static_lifetime_input_indices=cap.static_lifetime_input_indices)


def run_ours(cap: joint_capture.JointCapture, memory_budget: float, policy: str):
    """Our partitioner at RematConfig(memory_budget=...), on a copy of the joint graph:
    (forward, backward, BudgetSummary). Raises BudgetInfeasibleError below our smallest cut."""
    from deepcompile_remat.config import RematConfig
    from deepcompile_remat.partition import reports
    from deepcompile_remat.planning import remat_partition_fn

    partition_fn = remat_partition_fn(RematConfig(policy=policy, memory_budget=memory_budget))
    with compiling(cap):
        fw, bw = partition_fn(copy.deepcopy(cap.joint), [], num_fwd_outputs=cap.num_fwd_outputs,
                              static_lifetime_input_indices=cap.static_lifetime_input_indices)
    return fw, bw, reports()[-1].budget


def _ours(cap, memory_budget, policy, meter, *, byte_limit: Optional[float] = None
          ) -> tuple[Measured, object]:
    """Ours at memory_budget, measured; infeasible below our smallest cut. A byte budget says
    so by raising; a limit of 0 or 1 bytes goes in as the fraction 0 (absolute_budget), which
    gives the smallest cut rather than an error, so byte_limit, that limit, is checked here."""
    from deepcompile_remat.partition.budget import BudgetInfeasibleError

    try:
        fw, bw, summary = run_ours(cap, memory_budget, policy)
    except BudgetInfeasibleError as err:
        return Measured(infeasible_min_bytes=float(err.min_bytes)), None
    measured = meter.measure(fw, bw)
    if byte_limit is not None and measured.saved_bytes > byte_limit:
        return Measured(infeasible_min_bytes=float(measured.saved_bytes)), None
    return measured, summary


def absolute_budget(nbytes: float) -> float:
    """A byte count as RematConfig.memory_budget, which reads a number <= 1 as a fraction: a
    cut of 0 or 1 bytes asks for the fraction 0, our smallest cut (no tensor we could save is
    1 byte but a bool scalar), which _ours then holds to the byte count."""
    return float(nbytes) if nbytes > 1 else 0.0


# --- comparison --------------------------------------------------------------------------------

def _worse_on_both(a: Measured, b: Measured) -> bool:
    """a saves more bytes and recomputes more than b."""
    return a.feasible and b.feasible and a.saved_bytes > b.saved_bytes and (
        a.recompute_flops > b.recompute_flops)


def _not_monotone(larger: Measured, smaller: Measured) -> bool:
    """A smaller budget (`smaller`) that saves more, or recomputes less, than a larger one."""
    return larger.feasible and smaller.feasible and (
        smaller.saved_bytes > larger.saved_bytes or
        smaller.recompute_flops < larger.recompute_flops)


def _op_kinds(names: Sequence[str]) -> str:
    """'sdpa_for_cpu x2'-style summary of node names (their trailing _N dropped)."""
    import re

    counts: dict[str, int] = {}
    for name in names:
        kind = "sdpa" if "scaled_dot_product" in name else re.sub(r"_\d+$", "", name)
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{k} x{c}" if c > 1 else k for k, c in counts.items())


def _differs(measured: float, solver: Optional[float]) -> bool:
    return solver is not None and not math.isclose(measured, solver, rel_tol=1e-9, abs_tol=1.0)


def flag_rows(rows: Sequence[BudgetRow]) -> None:
    """Sets each row's flags (module docstring); rows in budget order, largest first."""
    for row in rows:
        if _worse_on_both(row.ours, row.torch):
            row.flags.append("worse on both")
        at = row.ours_at_torch_bytes
        if at.feasible and at.saved_bytes > row.torch.saved_bytes:
            row.flags.append("ours@torch over torch's bytes")
        hull = row.hull_flops_at_torch_bytes
        if at.feasible and at.recompute_flops > row.torch.recompute_flops:
            # Allowed by our contract only within the solver's stated optimality gap (ours lies
            # on a hull edge, up to one walk step short of the hull's cost at the budget).
            promised = (hull or 0.0) + (row.ours_at_torch_optimality_gap or 0.0)
            within = at.recompute_flops <= promised * (1 + 1e-9) + 1.0
            row.flags.append("ours@torch costs more ("
                             + ("within our gap)" if within else "BEYOND our gap)"))
        if row.torch.recomputed_banned:
            # Then torch's point may lie below our hull: it is not a cut we may take.
            row.flags.append("torch recomputes ops we ban ("
                             + _op_kinds(row.torch.recomputed_banned) + ")")
        elif hull is not None and row.torch.recompute_flops < hull * (1 - 1e-9) - 1.0:
            row.flags.append("torch below our hull")
        if row.ours.feasible and (_differs(row.ours.saved_bytes, row.ours_solver_bytes) or
                                  _differs(row.ours.recompute_flops, row.ours_solver_flops)):
            row.flags.append("measured != solver")
    ordered = sorted(rows, key=lambda r: -r.budget)
    for larger, smaller in zip(ordered, ordered[1:]):
        if _not_monotone(larger.torch, smaller.torch):
            smaller.flags.append("torch non-monotone")
        if _not_monotone(larger.ours, smaller.ours):
            smaller.flags.append("ours non-monotone")


def bench_graph(model: str, cap: joint_capture.JointCapture, budgets: Sequence[float], *,
                torch_solver: str, policy: str, sizes: Workload) -> GraphResult:
    """Every budget on one captured graph, both partitioners (module docstring)."""
    t0 = time.perf_counter()
    meter = Meter(cap, policy)
    rows = []
    for b in budgets:
        theirs = meter.measure(*run_torch(cap, b, torch_solver))
        ours, summary = _ours(cap, b, policy, meter)
        limit = theirs.saved_bytes  # 0 or 1 bytes go in as the fraction 0: checked after
        at, at_summary = _ours(cap, absolute_budget(limit), policy, meter,
                               byte_limit=limit if limit <= 1 else None)
        rows.append(BudgetRow(
            b, theirs, ours, at,
            ours_solver_bytes=summary.saved_bytes if summary else None,
            ours_solver_flops=summary.recompute_cost if summary else None,
            ours_at_torch_solver_bytes=at_summary.saved_bytes if at_summary else None,
            ours_at_torch_solver_flops=at_summary.recompute_cost if at_summary else None,
            hull_flops_at_torch_bytes=at_summary.hull_cost_at_budget if at_summary else None,
            ours_at_torch_optimality_gap=at_summary.optimality_gap if at_summary else None))
    flag_rows(rows)
    by_budget = {r.budget: r.torch.saved_bytes for r in rows}
    torch_range = (by_budget.get(0.0, math.nan), by_budget.get(1.0, math.nan))
    nodes = sum(1 for n in cap.joint.graph.nodes if n.op != "output")
    return GraphResult(model, sizes, nodes, torch_solver, torch_range, meter.ours_default_bytes,
                       rows, time.perf_counter() - t0)


# --- output ------------------------------------------------------------------------------------

def _mb(m: Measured) -> str:
    if not m.feasible:
        return f"infeasible (min {m.infeasible_min_bytes / MB:.3f})"
    return f"{m.saved_bytes / MB:.3f}"


def _gflop(m: Measured) -> str:
    return "-" if not m.feasible else f"{m.recompute_flops / GFLOP:.4f}"


COLUMNS = [
    ("budget", lambda r: f"{r['row'].budget:g}"),
    ("torch saved MB", lambda r: _mb(r["row"].torch)),
    ("torch recompute GFLOP", lambda r: _gflop(r["row"].torch)),
    ("ours saved MB", lambda r: _mb(r["row"].ours)),
    ("ours recompute GFLOP", lambda r: _gflop(r["row"].ours)),
    ("ours@torch's bytes GFLOP", lambda r: _gflop(r["row"].ours_at_torch_bytes)),
    ("hull@torch's bytes GFLOP", lambda r: "-" if r["row"].hull_flops_at_torch_bytes is None
     else f"{r['row'].hull_flops_at_torch_bytes / GFLOP:.4f}"),
    ("flags", lambda r: ", ".join(r["row"].flags) or "-"),
]


def format_result(result: GraphResult) -> str:
    """One graph's table, under a header that states what is measured and how."""
    s = result.sizes
    lo, hi = result.torch_range_bytes
    head = [
        f"{result.model}: {s.layers} layers, hidden {s.hidden}, {s.heads} heads, seq {s.seq}, "
        f"batch {s.batch}, vocab {s.vocab}; {result.graph_nodes} joint-graph nodes; torch "
        f"solver {result.torch_solver}; {result.seconds:.1f} s",
        f"budget fractions: torch's of [inputs only, default cut] = [{lo / MB:.3f}, "
        f"{hi / MB:.3f}] MB; ours of our default cut = {result.ours_default_bytes / MB:.3f} MB",
        "saved MB: forward outputs handed to the backward, 1x, parameters and their views free; "
        "recompute GFLOP: the same estimator for both sides (our recompute_cost_of over the "
        "recomputed forward ops that are not free to recompute)",
    ]
    table = format_table([{"row": r} for r in result.rows], COLUMNS)
    return "\n".join(head) + "\n" + table


def _finite_or_none(x):
    """JSON has no NaN: NaN and infinities become null, recursively."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_none(v) for v in x]
    return x


def _jsonable(result: GraphResult) -> dict:
    """One graph's result as plain JSON values (infeasible sides: only their min bytes)."""
    d = asdict(result)
    for row, raw in zip(d["rows"], result.rows):
        for side in ("torch", "ours", "ours_at_torch_bytes"):
            m = getattr(raw, side)
            row[side] = asdict(m) if m.feasible else {
                "infeasible_min_bytes": m.infeasible_min_bytes}
    return _finite_or_none(d)


def _torch_solver_available(solver: str) -> Optional[str]:
    """None, or why torch's `solver` cannot run here (ilp needs scipy)."""
    if solver == "ilp":
        try:
            import scipy.optimize  # noqa: F401
        except ImportError:
            return "torch's ilp knapsack solver needs scipy, which is not installed"
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """bench-budget's options (run's docstring has its help line)."""
    parser.add_argument("--model", choices=MODELS, action="append",
                        help="gpt (built-in) or llama (transformers); repeat for both "
                             "(default: both)")
    parser.add_argument("--budgets", type=float, nargs="+", default=list(DEFAULT_BUDGETS),
                        help="fractions in [0, 1] (default 1.0 0.9 ... 0.0)")
    parser.add_argument("--solver", choices=SOLVERS, default="dp",
                        help="torch's activation_memory_budget_solver (default dp)")
    parser.add_argument("--policy", choices=("conservative", "aggressive"),
                        default="conservative", help="our RematConfig.policy")
    parser.add_argument("--layers", type=int, default=SIZES.layers)
    parser.add_argument("--hidden", type=int, default=SIZES.hidden)
    parser.add_argument("--seq", type=int, default=SIZES.seq)
    parser.add_argument("--out", help="directory for results.json and table.txt")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def run(args: argparse.Namespace) -> int:
    """Saved bytes and recompute cost: our memory budget against torch's, per budget."""
    reason = _torch_solver_available(args.solver)
    if reason:
        print(f"bench-budget: skipped: {reason} (try --solver dp or greedy)")
        return 0
    bad = [b for b in args.budgets if not 0.0 <= b <= 1.0]
    if bad:
        raise SystemExit(f"bench-budget: budgets must be fractions in [0, 1], got {bad}")
    budgets = sorted(set(args.budgets), reverse=True)
    sizes = dataclasses.replace(SIZES, layers=args.layers, hidden=args.hidden, seq=args.seq)
    results = []
    for model in args.model or MODELS:
        cap = capture(model, sizes)
        results.append(bench_graph(model, cap, budgets, torch_solver=args.solver,
                                   policy=args.policy, sizes=sizes))
        if not args.json:
            print(format_result(results[-1]) + "\n", flush=True)
    payload = [_jsonable(r) for r in results]
    if args.json:
        print(json.dumps(payload, indent=1))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(payload, f, indent=1)
        with open(os.path.join(args.out, "table.txt"), "w") as f:
            f.write("\n\n".join(format_result(r) for r in results) + "\n")
    return 0
