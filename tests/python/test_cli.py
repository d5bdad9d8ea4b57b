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


def test_profile_zero3_rows(capsys):
    # Two gloo ranks, a tiny GPT: every setup measures a peak, and ours sends far fewer bytes
    # than marking without cast-before-gather (bf16 instead of fp32 on the wire).
    assert cli.main(["profile-zero3", "--json", "--layers", "1", "--hidden", "64", "--heads", "2",
                     "--seq", "16", "--vocab", "64", "--steps", "1"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted((r["setup"], r["rank"]) for r in rows) == sorted(
        (s, rank) for s in ("torch-default", "mincut-marking", "ours") for rank in (0, 1))
    by = {(r["setup"], r["rank"]): r for r in rows}
    for rank in (0, 1):
        assert all(by[s, rank]["peak_mb"] > 0 and by[s, rank]["predicted_peak_mb"] > 0
                   for s in ("torch-default", "mincut-marking", "ours"))
        ours, marking = by["ours", rank], by["mincut-marking", rank]
        assert 0 < ours["allgather_mb_per_step"] < 0.75 * marking["allgather_mb_per_step"]
