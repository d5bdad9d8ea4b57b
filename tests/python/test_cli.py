"""Smoke tests of the `deepcompile-remat` command line at tiny sizes."""
from __future__ import annotations

import json

import pytest

from deepcompile_remat import cli
from deepcompile_remat.bench.joint_graphs import transformer_joint_graph


def test_bench_solver_table(capsys):
    assert cli.main(["bench-solver", "--max-nodes", "1000"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split()
    assert header[:2] == ["nodes", "arcs"] and "bk" in header and header[-1] == "agree"
    rows = [line for line in lines[2:] if line and line[0] in " 0123456789"]
    assert len(rows) == 1
    assert rows[0].split()[-1] == "yes"
    assert rows[0].split()[-2].endswith("x")  # networkx ran, so there is a ratio


def test_bench_solver_json(capsys):
    assert cli.main(["bench-solver", "--max-nodes", "1000", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1
    row = rows[0]
    assert row["agree"] is True
    assert 900 <= row["nodes"] <= 1100 and row["flow_nodes"] == 2 * row["nodes"] + 2
    assert row["arcs"] > row["nodes"] and row["cut_value"] > 0
    assert row["ours_ms"] > 0 and row["bk_ms"] > 0 and row["networkx_ms"] > 0
    assert row["ratio"] == pytest.approx(row["networkx_ms"] / row["ours_ms"])


def test_bench_solver_skips_networkx_past_the_limit(capsys):
    # A zero limit keeps networkx for the first size only (nothing to extrapolate from).
    assert cli.main(["bench-solver", "--max-nodes", "2000", "--networkx-limit-s", "0",
                     "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["networkx_ms"] is None for row in rows] == [False, True]
    assert all(row["agree"] for row in rows)


def test_unknown_subcommand_is_rejected():
    with pytest.raises(SystemExit):
        cli.main(["no-such-command"])


def test_joint_graph_is_deterministic_and_a_dag():
    first, second = transformer_joint_graph(3, seed=5), transformer_joint_graph(3, seed=5)
    assert (first.node_costs == second.node_costs).all()
    assert (first.edge_tails == second.edge_tails).all()
    assert (first.edge_tails < first.edge_heads).all()  # nodes are created in topological order
    assert (first.node_costs % 4096 == 0).all()
    assert set(first.source_nodes.tolist()).isdisjoint(first.sink_nodes.tolist())


def test_profile_two_ranks(tmp_path, capsys):
    # Two gloo ranks, a tiny GPT, eager: the table, results.json/.csv and the PNGs are written;
    # the ranks run the same graphs, so they measure the same peaks (the allocator counts
    # gloo's threads too: no drift between ranks) up to one tensor that gloo's worker thread
    # may release a moment later on one rank; ours keeps no gathered weight for the backward
    # and, under autocast, moves half the bytes of marking's fp32 gathers.
    out = tmp_path / "out"
    assert cli.main(["profile", "--backends", "eager", "--precisions", "autocast", "--layers", "1",
                     "--hidden", "64", "--heads", "2", "--seq", "8", "--vocab", "64",
                     "--steps", "1", "--warmup", "0", "--quiet", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "eager+autocast" in text and "Korthikanti" in text
    data = json.loads((out / "results.json").read_text())
    rows = data["rows"]
    assert sorted((r["setup"], r["rank"]) for r in rows) == sorted(
        (s, rank) for s in ("baseline", "marking", "ours") for rank in (0, 1))
    by = {(r["setup"], r["rank"]): r for r in rows}
    for setup in ("baseline", "marking", "ours"):
        r0, r1 = by[setup, 0], by[setup, 1]
        assert r0["exact_counter"] and r0["peak_bytes"] > 0 and r0["predicted_peak_bytes"] > 0
        assert r0["peak_bytes"] >= r0["fw_peak_bytes"] and r0["timeline"]["t_ms"]
        largest_fp32_weight = 4 * 64 * 4 * 64
        assert abs(r0["peak_bytes"] - r1["peak_bytes"]) <= max(0.02 * r0["peak_bytes"],
                                                               largest_fp32_weight)
    for rank in (0, 1):
        assert by["baseline", rank]["saved_weight_bytes"] > 0
        assert by["ours", rank]["saved_weight_bytes"] == 0
        ours, marking = by["ours", rank], by["marking", rank]
        assert 0 < ours["gathered_bytes"] < 0.75 * marking["gathered_bytes"]
    assert (out / "results.csv").read_text().count("\n") == len(rows) + 1
    for png in ("memory_timeline.png", "peaks.png"):
        assert (out / png).stat().st_size > 0


def test_profile_rejects_a_run_without_ranks():
    with pytest.raises(SystemExit):
        cli.main(["profile", "--world", "0"])


@pytest.mark.parametrize("command,flags,flag", [
    ("profile", ["--layers", "0"], "--layers"),
    ("compare", ["--hidden", "100"], "--hidden"),
    ("compare", ["--seq", "-1"], "--seq"),
])
def test_model_flags_are_checked_before_anything_runs(command, flags, flag):
    """Both measuring commands share the model flags (profile/workload.py) and their checks."""
    with pytest.raises(SystemExit, match=f"deepcompile-remat {command}: {flag}"):
        cli.main([command, *flags])
