"""Our setup lowers the peak: `deepcompile-remat profile` at a size where weights dominate.

An emulated world of 8 (torch's fake process group, one process: per-rank memory exact,
collectives skipped) under autocast, eager and inductor. What the baseline keeps for the
backward is read from its own saved values (`kept`: gathered weights, their views and bf16
copies), not from a constant. Ours keeps none of it, so across the forward/backward boundary
ours holds at least `kept` bytes fewer. The step's peak drops by `kept` less two things ZeRO-3
must hold in the backward either way, both derived from the model: the fp32 gradient shards,
which the compiled backward returns all together (`grads`), and one re-gathered weight with
its bf16 and fp32 gradients (`one_layer`).
"""
from __future__ import annotations

import json
import math

import pytest

from dcr_bench import cli
from dcr_bench.profile import results

WORLD = 8
SIZE = {"layers": 4, "hidden": 256, "heads": 4, "seq": 8, "vocab": 256, "batch": 1}


def _matrices(size):
    """numel of the 2-D weights autocast runs in bf16 (the linear layers, head included)."""
    d, v = size["hidden"], size["vocab"]
    per_block = [3 * d * d, d * d, 4 * d * d, 4 * d * d]
    return per_block * size["layers"] + [d * v]


def _parameters(size):
    d, v, t = size["hidden"], size["vocab"], size["seq"]
    block = [2 * d, 2 * d, 3 * d * d, 3 * d, d * d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    return block * size["layers"] + [v * d, t * d, d, d, d * v]


@pytest.fixture(scope="module")
def emulated_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    argv = ["profile", "--world", "0", "--fake-world", str(WORLD), "--precisions", "autocast",
            "--setups", "baseline", "ours", "--steps", "1", "--warmup", "0",
            "--profiled-steps", "1", "--quiet",
            "--no-plots", "--out", str(out)]
    for k, v in SIZE.items():
        argv += [f"--{k}", str(v)]
    assert cli.main(argv) == 0
    rows, meta = results.load(str(out / "results.json"))
    assert {(r["backend"], r["setup"]) for r in rows} == {
        (b, s) for b in ("eager", "inductor") for s in ("baseline", "ours")}
    assert all(r["emulated"] and r["world"] == WORLD and r["exact_counter"] for r in rows)
    return results.fold(rows)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_ours_lowers_the_peak_by_the_weights_the_baseline_keeps(emulated_run, backend):
    base = results.cell(emulated_run, backend, "autocast", "baseline")
    ours = results.cell(emulated_run, backend, "autocast", "ours")
    kept = base["saved_weight_bytes"]
    # The premise: torch's partitioner keeps (nearly) every bf16 weight for the backward.
    assert kept >= 0.9 * 2 * sum(_matrices(SIZE))
    assert ours["saved_weight_bytes"] == 0
    # Across the boundary: ours holds at least `kept` fewer bytes when the forward ends.
    assert ours["boundary_bytes"] <= base["boundary_bytes"] - kept + 0.02 * kept
    # The peak: lower by `kept`, less the gradient shards and one layer's re-gather.
    grads = sum(4 * -(-n // WORLD) for n in _parameters(SIZE))
    one_layer = 8 * max(_matrices(SIZE))  # bf16 copy 2 + bf16 grad 2 + fp32 grad 4 bytes
    assert kept - grads - one_layer > 0.25 * kept  # the bound below says something
    assert ours["peak_bytes"] <= base["peak_bytes"] - kept + grads + one_layer
    assert ours["fw_peak_bytes"] <= base["fw_peak_bytes"] - kept + one_layer


@pytest.mark.parametrize("setup", ["baseline", "ours"])
def test_simulator_predicts_the_eager_peak(emulated_run, setup):
    # Eager runs the partitioned FX graphs in their order, so the memory simulator's peak is
    # the measured one up to what happens outside the graphs (loss, gradient accumulation).
    c = results.cell(emulated_run, "eager", "autocast", setup)
    assert c["predicted_peak_bytes"] == pytest.approx(c["peak_bytes"], rel=0.05)


def test_results_are_json_serializable(emulated_run):
    json.dumps({str(k): v for k, v in emulated_run.items()})


def test_korthikanti_formula_sums_its_parts():
    s, b, h, a = 16, 2, 64, 4
    attention, mlp, norms = 11 * s * b * h + 5 * a * s * s * b, 19 * s * b * h, 4 * s * b * h
    assert results.korthikanti_bytes_per_layer(s, b, h, a, dropout=True) == attention + mlp + norms
    masks = s * b * h + s * b * h + a * s * s * b  # attention out, MLP out, softmax
    softmax_output_read_twice = 2 * a * s * s * b
    assert results.korthikanti_bytes_per_layer(s, b, h, a) == (
        attention + mlp + norms - masks - softmax_output_read_twice)


@pytest.mark.parametrize("kind", ["eager", "inductor"])
def test_backend_shows_every_partition_to_its_observer(kind):
    # on_partition sees the (fw, bw) pair whichever partitioner runs: ours, or torch's when the
    # config is disabled (inductor: its own min-cut, through the custom-partitioner hook).
    import torch
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from deepcompile_remat import RematConfig, backend

    seen = []
    with inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        for config in (RematConfig(), RematConfig(enabled=False)):
            torch._dynamo.reset()
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                        torch.nn.Linear(8, 1))
            run = torch.compile(model, backend=backend(
                kind, config, on_partition=lambda fw, bw, inputs: seen.append((fw, bw, inputs))))
            x = torch.randn(4, 8)
            run(x).sum().backward()
            expected = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            model(x).sum().backward()
            for p, g in zip(model.parameters(), expected):
                torch.testing.assert_close(p.grad, g)
    assert len(seen) == 2
    for fw, bw, inputs in seen:
        assert isinstance(fw, torch.fx.GraphModule) and isinstance(bw, torch.fx.GraphModule)
        assert sum(isinstance(i, torch.nn.Parameter) for i in inputs) == 4


TINY = ["--layers", "1", "--hidden", "64", "--heads", "2", "--seq", "8", "--vocab", "64"]


def test_budgets_are_cells_after_the_setups():
    from dcr_bench.profile.setups import PROFILE_BUCKET_BYTES, Cell, matrix

    cells = matrix(["eager"], ["autocast", "bf16"], ["baseline", "ours"], [1, 0.5, 1])
    assert [c.name for c in cells] == [
        f"eager/{p}/{s}" for p in ("autocast", "bf16")
        for s in ("baseline", "ours", "ours@1", "ours@0.5")]
    budget_cell = cells[2]
    assert budget_cell.config().memory_budget == 1
    assert budget_cell.config() == type(budget_cell.config())(
        memory_budget=1, bucket_bytes=PROFILE_BUCKET_BYTES)
    assert cells[1].config().memory_budget is None
    with pytest.raises(ValueError, match="budget runs the 'ours' setup"):
        Cell("eager", "autocast", "regather", budget=0.5)
    with pytest.raises(ValueError, match=">= 0"):
        Cell("eager", "autocast", "ours", budget=-1.0)


def test_profile_budgets(tmp_path, capsys):
    # Two gloo ranks, a tiny GPT, eager: ours and ours@1, @0.3, @0, @2. Each feasible budget
    # row holds budget mode's decision, and what it saves fits its budget; budget 1 is the
    # ordinary cut's bytes; a smaller budget recomputes at least as much. Budget 0 is the
    # smallest legal cut, a real row (it was an infeasible one), above 0 bytes here (ZeRO-3's
    # marking and the RNG rules make some values unrecomputable); a byte budget of 2 is below
    # it: a row saying so, not a crash.
    out = tmp_path / "out"
    assert cli.main(["profile", "--backends", "eager", "--precisions", "autocast",
                     "--setups", "ours", "--budgets", "1", "0.3", "0", "2", *TINY, "--steps",
                     "1", "--warmup", "0", "--profiled-steps", "1", "--quiet",
                     "--out", str(out), "--op-table"]) == 0
    text = capsys.readouterr().out
    rows, meta = results.load(str(out / "results.json"))
    assert meta["budgets"] == [1.0, 0.3, 0.0, 2.0]
    setups = ("ours", "ours@1", "ours@0.3", "ours@0", "ours@2")
    assert sorted((r["setup"], r["rank"]) for r in rows) == sorted(
        (s, rank) for s in setups for rank in (0, 1))
    folded = results.fold(rows)
    ours, full, part, zero, two_bytes = (results.cell(folded, "eager", "autocast", s)
                                         for s in setups)
    assert ours["budget"] is None and not ours["infeasible"]
    for budget, c in ((1.0, full), (0.3, part)):
        assert c["budget"] == budget and not c["infeasible"] and c["budget_graphs"] >= 1
        assert c["budget_saved_bytes"] <= c["budget_bytes"]
        assert c["budget_bytes"] == pytest.approx(budget * c["budget_default_saved_bytes"],
                                                  abs=c["budget_graphs"])
        assert c["peak_bytes"] > 0 and c["step_s"] > 0 and c["optimality_gap_flops"] >= 0
    assert full["budget_saved_bytes"] == full["budget_default_saved_bytes"] > 0
    assert part["recompute_flops"] >= full["recompute_flops"]
    assert part["budget_saved_bytes"] < full["budget_saved_bytes"]
    assert not zero["infeasible"] and zero["peak_bytes"] > 0
    assert 0 < zero["budget_saved_bytes"] == zero["budget_bytes"] < part["budget_saved_bytes"]
    assert zero["recompute_flops"] >= part["recompute_flops"]
    assert two_bytes["infeasible"] and math.isnan(two_bytes["peak_bytes"])
    assert two_bytes["min_budget_bytes"] > 2
    assert "ours@2       infeasible (min" in text
    assert "memory budget: ours@B" in text
    assert (out / "results.csv").read_text().count("\n") == len(rows) + 1
    assert "budget_saved_bytes" in (out / "results.csv").read_text().splitlines()[0]
    assert (out / "budgets.png").stat().st_size > 0
    # --op-table: rank 0's per-op profile of each profiled cell (an infeasible one has none)
    tables = {p.name: p.read_text() for p in (out / "ops").iterdir()}
    assert set(tables) == {f"eager-autocast-{s}-w2.ops.txt" for s in setups[:-1]}
    assert all("dcr::allgather_cast" in t and "self_cpu_time_total" in t for t in tables.values())


def test_timeline_aligns_phases_and_keeps_every_peak():
    """Guards against a memory_timeline.png that misleads: each setup's forward end must land
    on the shared "forward ends" mark, and binning the line must never hide a peak (a buffer
    alive for one event) nor invent memory that was never held."""
    import numpy as np

    from dcr_bench.profile import plots

    timeline = {"t_ms": [0.0, 10.0, 30.0, 30.5, 40.0, 99.0, 100.0],
                "bytes": [0.0, 5.0, 2.0, 9.0, 1.0, 0.0, 0.0],
                "fw_end_ms": 30.0, "release_ms": 99.0, "step_end_ms": 100.0}
    x = plots.phase_progress(timeline["t_ms"], timeline)
    assert x[2] == pytest.approx(1.0) and x[5] == pytest.approx(2.0)
    total = sum(w for _, w, _ in plots.PHASES)
    assert x[-1] == pytest.approx(total)
    edges, high = plots.high_water(x, timeline["bytes"], total)
    assert high.max() == 9.0  # the 0.5 ms spike survives
    assert edges[0] == 0 and edges[-1] == pytest.approx(total)
    assert set(np.unique(high)) <= set(timeline["bytes"])
    # An older results.json without the backward's end: a release of zero length.
    old = {k: v for k, v in timeline.items() if k != "release_ms"}
    assert plots.phase_edges(old) == (30.0, 100.0, 100.0)
