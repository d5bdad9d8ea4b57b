"""bench-budget (benchmarks/dcr_bench/bench/budget.py): the command runs on a tiny GPT, both sides
are measured, our budget cut is monotone, and at torch's own bytes ours is no worse than our
solver promises."""
import json
import math

import pytest

from dcr_bench import cli
from dcr_bench.bench import budget as bench_budget

BUDGETS = (1.0, 0.5, 0.0)


@pytest.fixture(scope="module")
def tiny_gpt(tmp_path_factory):
    """results.json and table.txt of bench-budget on a 1-layer GPT, 3 budgets."""
    out = tmp_path_factory.mktemp("bench-budget")
    assert cli.main(["bench-budget", "--model", "gpt", "--layers", "1", "--hidden", "32",
                     "--seq", "16", "--budgets", *map(str, BUDGETS), "--out", str(out)]) == 0
    with open(out / "results.json") as f:
        results = json.load(f)
    return results, (out / "table.txt").read_text()


def test_rows_have_both_sides(tiny_gpt):
    results, table = tiny_gpt
    assert [r["model"] for r in results] == ["gpt"]
    rows = results[0]["rows"]
    assert [r["budget"] for r in rows] == list(BUDGETS)
    for row in rows:
        assert row["torch"]["saved_bytes"] >= 0 and row["torch"]["recompute_flops"] >= 0
        ours = row["ours"]
        assert ours.get("saved_bytes") is not None or ours["infeasible_min_bytes"] > 0
        assert "worse on both" not in row["flags"]
    for header in ("torch saved MB", "ours recompute GFLOP", "ours@torch's bytes GFLOP"):
        assert header in table
    # Budget 1.0 is each side's default cut; 0.0 is torch's inputs-only cut.
    assert rows[0]["ours"]["saved_bytes"] == results[0]["ours_default_bytes"]
    assert results[0]["torch_range_bytes"][1] == rows[0]["torch"]["saved_bytes"]


def test_ours_is_monotone_and_measured_as_the_solver_says(tiny_gpt):
    rows = tiny_gpt[0][0]["rows"]
    feasible = [r for r in rows if r["ours"].get("saved_bytes") is not None]
    assert len(feasible) >= 2
    for larger, smaller in zip(feasible, feasible[1:]):
        assert smaller["ours"]["saved_bytes"] <= larger["ours"]["saved_bytes"]
        assert smaller["ours"]["recompute_flops"] >= larger["ours"]["recompute_flops"]
    for row in feasible:  # modules measured = what the solver decided: one convention
        assert row["ours"]["saved_bytes"] == pytest.approx(row["ours_solver_bytes"])
        assert row["ours"]["recompute_flops"] == pytest.approx(row["ours_solver_flops"])
        assert "ours non-monotone" not in row["flags"]


def test_ours_at_torchs_bytes_is_no_worse_than_promised(tiny_gpt):
    """Within torch's bytes ours saves no more, and recomputes no more than torch beyond the
    optimality gap our solver states (budget_cut.h, "Choice"); torch's cut, when it is one we
    may take, never beats our hull's lower bound."""
    for row in tiny_gpt[0][0]["rows"]:
        at, theirs = row["ours_at_torch_bytes"], row["torch"]
        assert at["saved_bytes"] <= theirs["saved_bytes"]
        slack = row["ours_at_torch_optimality_gap"]
        assert at["recompute_flops"] <= theirs["recompute_flops"] + slack + 1.0
        if not theirs["recomputed_banned"]:
            assert row["hull_flops_at_torch_bytes"] <= theirs["recompute_flops"] + 1.0


def test_flags_mark_non_monotone_steps():
    """flag_rows marks a smaller budget that saves more (or recomputes less) on either side."""
    M = bench_budget.Measured
    rows = [bench_budget.BudgetRow(0.5, M(100.0, 10.0), M(80.0, 20.0), M(100.0, 10.0)),
            bench_budget.BudgetRow(0.4, M(120.0, 5.0), M(60.0, 30.0), M(100.0, 10.0))]
    bench_budget.flag_rows(rows)
    assert "torch non-monotone" in rows[1].flags
    assert "ours non-monotone" not in rows[1].flags
    assert not rows[0].flags


def test_worse_on_both_is_flagged():
    M = bench_budget.Measured
    row = bench_budget.BudgetRow(0.5, M(100.0, 10.0), M(120.0, 20.0), M(100.0, 10.0))
    bench_budget.flag_rows([row])
    assert row.flags == ["worse on both"]


def test_absolute_budget_never_reads_as_a_fraction():
    assert bench_budget.absolute_budget(1024.0) == 1024.0
    assert bench_budget.absolute_budget(1.0) == 0.0
    assert not math.isnan(bench_budget.absolute_budget(0.0))


def test_ilp_without_scipy_is_skipped_with_a_note(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "scipy.optimize", None)  # import fails: as if absent
    assert cli.main(["bench-budget", "--solver", "ilp"]) == 0
    assert "needs scipy" in capsys.readouterr().out
