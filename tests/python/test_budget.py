"""Memory-budget mode (partition/budget.py over csrc/partition/budget_cut): budgets respected,
monotone decisions, ZeRO-3 aliases never saved, numerics equal to eager, on small real joint
graphs traced with AOTAutograd."""
import math

import numpy as np
import pytest
import torch
from functorch.compile import aot_function, make_boxed_func

from deepcompile_remat import _C
from deepcompile_remat.partition import budget

_PARAMETER_ALIAS = int(_C.NodeInfoBit.PARAMETER_ALIAS)


def mlp(x, w1, w2, w3):
    h = torch.relu(x @ w1.t())
    h = torch.tanh(h @ w2.t()) * h
    return torch.relu(h @ w3.t())


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 16, generator=g, requires_grad=True)
    ws = [torch.randn(16, 16, generator=g, requires_grad=True) for _ in range(3)]
    return [x, *ws]


@pytest.fixture(scope="module")
def graph():
    return budget.trace_joint_graph(mlp, _inputs(), parameter_indices=[1, 2, 3])


@pytest.mark.parametrize("policy", ["conservative", "aggressive"])
def test_budget_sweep_fits_and_is_monotone(graph, policy):
    sweep = budget.BudgetSweep(graph, policy=policy)
    hull = sweep.hull()
    assert len(hull) >= 2, "a budget between the ends needs a trade-off"
    assert all(a.saved_bytes < b.saved_bytes and a.recompute_cost > b.recompute_cost
               for a, b in zip(hull, hull[1:]))
    lo, hi = hull[0].saved_bytes, hull[-1].saved_bytes
    prev = None
    for b in np.linspace(hi + 64, lo, 40):
        d = sweep.choose(b)
        assert d.point.saved_bytes <= b                          # (a)
        assert d.optimality_gap >= 0
        assert d.point.recompute_cost >= d.hull_cost_at_budget - 1e-9
        if prev is not None:                                     # (b)
            assert d.point.saved_bytes <= prev.point.saved_bytes
            assert d.point.recompute_cost >= prev.point.recompute_cost
        prev = d
    with pytest.raises(budget.BudgetInfeasibleError, match=str(int(lo))) as err:
        sweep.choose(lo - 1)
    assert err.value.min_bytes == lo


def test_parameter_aliases_never_saved_at_any_budget(graph):
    sweep = budget.BudgetSweep(graph, policy="aggressive")
    aliases = set(np.flatnonzero(sweep.node_info & _PARAMETER_ALIAS).tolist())
    assert aliases, "the weights' transposes should be marked"
    hull = sweep.hull()
    for b in np.linspace(hull[0].saved_bytes, hull[-1].saved_bytes, 25):
        assert not aliases & set(sweep.choose(b).point.saved_ids.tolist())
    for p in hull:
        assert not aliases & set(p.saved_ids.tolist())


def test_fraction_budget_is_of_the_default_cut(graph):
    """A fraction is of the default cut's bytes, raised to the smallest legal cut's (0 and
    every fraction below that floor: the least memory, never an error, as torch's
    activation_memory_budget); a byte count > 1 is taken as it is, even below the floor (the
    choice then refuses it). Guards against a fraction of 0 failing the compile."""
    sweep = budget.BudgetSweep(graph)
    default, least = sweep.default_saved_bytes(), sweep.min_saved_bytes()
    assert 0 < least < default / 2
    assert least == sweep.hull()[0].saved_bytes
    assert budget.resolve_budget(1.0, default, least) == default
    assert budget.resolve_budget(0.5, default, least) == math.floor(default / 2)
    assert budget.resolve_budget(0, default, least) == least
    assert budget.resolve_budget(least / default / 2, default, least) == least
    assert budget.resolve_budget(4096, default, least) == 4096.0
    assert budget.resolve_budget(2, default, least) == 2.0  # bytes: not raised to the floor
    assert sweep.choose(default).point.saved_bytes <= default
    with pytest.raises(ValueError):
        budget.resolve_budget(-0.5, default, least)


def test_recompute_cost_counts_matmul_flops(graph):
    costs = budget.recompute_costs(graph)
    mms = [i for i, n in enumerate(graph.nodes) if n.target is torch.ops.aten.mm.default
           and n.meta["val"].shape == (8, 16)]
    assert mms and all(costs[i] == 2 * 8 * 16 * 16 for i in mms)
    relu = next(i for i, n in enumerate(graph.nodes) if n.target is torch.ops.aten.relu.default)
    assert costs[relu] == 8 * 16


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.34, 0.67, 1.0])
def test_numerics_equal_eager(fraction):
    """(e) through the partitioner proper: RematConfig(memory_budget=...) gives eager's
    gradients bit for bit, and the report says the budget held. No fraction fails, however
    small (guards against budget 0 raising BudgetInfeasibleError, as it once did)."""
    import deepcompile_remat as dcr
    from deepcompile_remat.config import RematConfig
    from deepcompile_remat.partition import clear_reports, reports

    ref = _inputs(1)
    mlp(*ref).sum().backward()
    args = _inputs(1)
    clear_reports()
    nop = lambda gm, _: make_boxed_func(gm.forward)  # noqa: E731
    part = dcr.make_partition_fn(RematConfig(memory_budget=fraction, parameter_indices=(1, 2, 3)))
    out = aot_function(mlp, fw_compiler=nop, bw_compiler=nop, partition_fn=part)(*args)
    out.sum().backward()
    (rep,) = reports()
    assert rep.budget is not None and rep.budget.saved_bytes <= rep.budget.saved_bytes_budget
    assert rep.budget.optimality_gap >= 0
    for a, r in zip(args, ref):
        torch.testing.assert_close(a.grad, r.grad, rtol=0, atol=0)


def test_impossible_budget_names_the_smallest_feasible(graph):
    """(a) A budget below every legal cut is an error that names the smallest feasible one."""
    sweep = budget.BudgetSweep(graph)
    smallest = sweep.hull()[0].saved_bytes
    assert smallest > 0
    with pytest.raises(budget.BudgetInfeasibleError) as err:
        sweep.choose(smallest - 1)
    assert err.value.min_bytes == smallest and f"{smallest:.0f}" in str(err.value)
    assert sweep.choose(smallest).point.saved_bytes == smallest


def _partition_seeing_the_hull(config, hulls: list):
    """make_partition_fn(config), which first appends the hull of the joint graph it is handed
    (exported as the partitioner exports it: same DCE, CSE, static inputs and parameters)."""
    import copy

    import deepcompile_remat as dcr
    from deepcompile_remat.partition import cse, dce, fx_export

    ours = dcr.make_partition_fn(config)

    def partition(joint, joint_inputs, **kwargs):
        seen = copy.deepcopy(joint)
        dce.eliminate_dead_code(seen)
        cse.eliminate_common_subexpressions(seen.graph)
        graph = fx_export.export_joint_graph(
            seen, num_fwd_outputs=kwargs["num_fwd_outputs"],
            static_lifetime_input_indices=list(kwargs.get("static_lifetime_input_indices") or ()),
            parameter_indices=config.parameter_indices)
        hulls.append(budget.BudgetSweep(graph, policy=config.policy).hull())
        return ours(joint, joint_inputs, **kwargs)

    return partition


def test_budget_zero_saves_the_least_and_a_byte_budget_below_it_raises():
    """memory_budget=0 is the smallest legal cut (the hull's low end: its bytes exactly) with
    eager's gradients, not an error; a byte budget under that minimum still raises
    BudgetInfeasibleError naming it. Guards against budget 0 failing the compile (it raised
    'infeasible (min 128 bytes)'), and against a clamp that would also swallow a byte limit."""
    import deepcompile_remat as dcr
    from deepcompile_remat.config import RematConfig
    from deepcompile_remat.partition import clear_reports, reports

    ref = _inputs(1)
    mlp(*ref).sum().backward()
    args = _inputs(1)
    clear_reports()
    hulls = []
    nop = lambda gm, _: make_boxed_func(gm.forward)  # noqa: E731
    config = RematConfig(memory_budget=0, parameter_indices=(1, 2, 3))
    out = aot_function(mlp, fw_compiler=nop, bw_compiler=nop,
                       partition_fn=_partition_seeing_the_hull(config, hulls))(*args)
    out.sum().backward()
    for a, r in zip(args, ref):
        torch.testing.assert_close(a.grad, r.grad, rtol=0, atol=0)
    (hull,), (rep,) = hulls, reports()
    least = hull[0]
    assert len(hull) >= 2 and 0 < least.saved_bytes < hull[-1].saved_bytes
    assert rep.budget.saved_bytes_budget == least.saved_bytes
    assert rep.budget.saved_bytes == least.saved_bytes
    assert rep.budget.recompute_cost == least.recompute_cost  # the low end: least cost there
    assert rep.budget.saved_bytes < rep.budget.default_saved_bytes

    below = RematConfig(memory_budget=least.saved_bytes - 1, parameter_indices=(1, 2, 3))
    assert below.memory_budget > 1, "the test needs a byte budget"
    with pytest.raises(dcr.BudgetInfeasibleError) as err:
        aot_function(mlp, fw_compiler=nop, bw_compiler=nop,
                     partition_fn=_partition_seeing_the_hull(below, hulls))(*_inputs(1))
    assert err.value.min_bytes == least.saved_bytes
    assert f"{least.saved_bytes:.0f}" in str(err.value)


def test_chain_budget_reaches_sqrt_n_peak():
    """Seed 004 on a 16-layer chain: a budget point within one extra forward brings the
    backward's peak from ~n to ~2 sqrt(n) activations (benchmarks/scripts/budget_chain.py)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "scripts" / "budget_chain.py"
    spec = importlib.util.spec_from_file_location("budget_chain", path)
    chain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chain)
    row = chain.study(16)
    assert row["default_peak"] >= 16 and row["best_cost"] <= 1.0
    assert row["best_peak"] <= 2 * math.sqrt(16) + 4
    assert row["best_saved"] == 5  # the input and 4 evenly spaced checkpoints


@pytest.mark.parametrize("dropout_p,random", [(0.0, False), (0.3, True)])
@pytest.mark.parametrize("as_kwarg", [False, True])
def test_sdpa_without_dropout_is_an_ordinary_compute_intensive_op(dropout_p, random, as_kwarg):
    """SDPA carries torch's random tag for its dropout. With dropout_p == 0 it draws nothing,
    so budget mode may price and recompute it (as torch's budget solver does); with dropout it
    stays a random op, never run again without its forward RNG state."""
    import torch.fx as fx

    from deepcompile_remat.partition import op_classes

    g = fx.Graph()
    q, k, v = (g.placeholder(name) for name in "qkv")
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    args, kwargs = ((q, k, v), {"dropout_p": dropout_p}) if as_kwarg else ((q, k, v, dropout_p), {})
    node = g.call_function(op, args, kwargs)
    assert torch.Tag.nondeterministic_seeded in op.tags
    assert op_classes.draws_randomness(node) == random
    expected = op_classes.OpClass.RANDOM if random else op_classes.OpClass.COMPUTE_INTENSIVE
    assert op_classes.classify(node) == expected


def test_evaluate_prices_a_saved_set_as_the_sweep_does(graph):
    """BudgetSweep.evaluate (the planner's price of the ordinary cut) gives a hull point back
    exactly, and refuses a saved set that holds a parameter alias (which may not be saved)."""
    sweep = budget.BudgetSweep(graph)
    hull = sweep.hull()
    for p in hull:
        q = sweep.evaluate(p.saved_ids)
        assert (q.saved, q.recomputed, q.saved_bytes, q.recompute_cost) == (
            p.saved, p.recomputed, p.saved_bytes, p.recompute_cost)
    aliases = np.flatnonzero(sweep.node_info & int(_C.NodeInfoBit.PARAMETER_ALIAS))
    assert aliases.size
    with pytest.raises(ValueError, match="may not be saved"):
        sweep.evaluate([*hull[0].saved_ids, aliases[0]])
