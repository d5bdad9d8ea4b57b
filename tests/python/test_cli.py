"""Smoke tests of the `deepcompile-remat` command line at tiny sizes."""
from __future__ import annotations

import json
import re

import pytest

from dcr_bench import cli
from dcr_bench.bench.joint_graphs import transformer_joint_graph
from dcr_bench.profile import plots, results
from dcr_bench.profile.setups import SETUP_HELP


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
    # and, under autocast, moves half the bytes of regather's fp32 gathers; the baseline's
    # gathers are bucketed like ours (unbucketed: torch's partition without them).
    out = tmp_path / "out"
    assert cli.main(["profile", "--backends", "eager", "--precisions", "autocast", "--layers", "1",
                     "--hidden", "64", "--heads", "2", "--seq", "8", "--vocab", "64",
                     "--steps", "1", "--warmup", "0", "--quiet", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "eager+autocast" in text and "Korthikanti" in text
    data = json.loads((out / "results.json").read_text())
    rows = data["rows"]
    setups = ("unbucketed", "baseline", "regather", "ours")
    assert sorted((r["setup"], r["rank"]) for r in rows) == sorted(
        (s, rank) for s in setups for rank in (0, 1))
    by = {(r["setup"], r["rank"]): r for r in rows}
    for setup in setups:
        r0, r1 = by[setup, 0], by[setup, 1]
        assert r0["exact_counter"] and r0["peak_bytes"] > 0 and r0["predicted_peak_bytes"] > 0
        assert r0["peak_bytes"] >= r0["fw_peak_bytes"] and r0["timeline"]["t_ms"]
        largest_fp32_weight = 4 * 64 * 4 * 64
        assert abs(r0["peak_bytes"] - r1["peak_bytes"]) <= max(0.02 * r0["peak_bytes"],
                                                               largest_fp32_weight)
    for rank in (0, 1):
        assert by["baseline", rank]["saved_weight_bytes"] > 0
        assert by["ours", rank]["saved_weight_bytes"] == 0
        ours, regather = by["ours", rank], by["regather", rank]
        assert 0 < ours["gathered_bytes"] < 0.75 * regather["gathered_bytes"]
        # The baseline is torch's partition with ours' collective buckets: the same bytes in
        # fewer gathers than without them.
        base, unbucketed = by["baseline", rank], by["unbucketed", rank]
        assert base["gathered_bytes"] == unbucketed["gathered_bytes"]
        assert base["gather_calls"] < unbucketed["gather_calls"]
    assert (out / "results.csv").read_text().count("\n") == len(rows) + 1
    for png in ("memory_timeline.png", "peaks.png"):
        assert (out / png).stat().st_size > 0
    # The table says what its deltas compare and that lower is better, and what each setup is.
    assert results.DELTA_MEANING in text and "lower is better" in text
    for setup in setups:
        assert f"  {setup:<11} {SETUP_HELP[setup]}" in text
    assert "seed 003" not in text and "marking" not in text
    # The timeline a person reads: phases named, axes labelled with units, a legend entry per
    # setup it tells, what the forward keeps annotated.
    fig = plots.timeline_figure(rows, data["meta"]["model"],
                                parameters=data["meta"]["parameters"])
    ax = fig.axes[0]
    assert "progress through one training step" in ax.get_xlabel()
    assert "allocated memory" in ax.get_ylabel() and "MB" in ax.get_ylabel()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert [t.split(":")[0] for t in legend] == ["baseline", "regather", "ours"]
    assert all("Peak" in t and " ms" in t for t in legend)
    texts = [t.get_text() for t in ax.texts]
    assert "forward" in texts and "backward" in texts
    assert any(t.startswith("baseline keeps") and "gathered weights" in t for t in texts)
    assert any(t.startswith("ours keeps") and "no gathered weight" in t for t in texts)
    assert any(t.startswith("gradient shards (fp32, 1/2") for t in texts)
    assert any("Flat stretches" in t.get_text() for t in fig.texts)


def test_profile_rejects_a_run_without_ranks():
    with pytest.raises(SystemExit):
        cli.main(["profile", "--world", "0"])


@pytest.mark.parametrize("budget", ["-1", "nan", "inf", "half"])
def test_profile_rejects_a_budget_that_is_not_a_size(budget, capsys):
    with pytest.raises(SystemExit):
        cli.main(["profile", "--budgets", "1", budget])
    assert "--budgets" in capsys.readouterr().err


@pytest.mark.parametrize("command,flags,flag", [
    ("profile", ["--layers", "0"], "--layers"),
    ("compare", ["--hidden", "100"], "--hidden"),
    ("compare", ["--seq", "-1"], "--seq"),
])
def test_model_flags_are_checked_before_anything_runs(command, flags, flag):
    """Both measuring commands share the model flags (harness/workload.py) and their checks."""
    with pytest.raises(SystemExit, match=f"deepcompile-remat {command}: {flag}"):
        cli.main([command, *flags])


def _gpt2_config_json(tmp_path, **sizes):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    transformers.GPT2Config(**{"vocab_size": 40, "n_embd": 32, "n_layer": 1, "n_head": 4,
                               "n_positions": 32, **sizes}).to_json_file(str(path))
    return str(path)


@pytest.mark.parametrize("command", ["profile", "compare", "bench-deepspeed"])
def test_a_config_json_is_the_model_it_describes(tmp_path, command):
    """--model path/to/config.json builds that architecture at its own sizes, whatever the
    command's defaults (bench-deepspeed's: 8 layers, hidden 1024). Silent bug guarded: the
    defaults' vocab (512) feeding token ids past the config's (40) or describing another model."""
    import math

    from dcr_bench.bench import deepspeed_bench
    from dcr_bench.harness.workload import workload_from_args

    path = _gpt2_config_json(tmp_path)
    args = cli.build_parser().parse_args([command, "--model", path, "--seq", "8"])
    w = workload_from_args(args, command, deepspeed_bench.SIZES
                           if command == "bench-deepspeed" else None)
    assert (w.model, w.layers, w.hidden, w.heads, w.vocab, w.seq) == (path, 1, 32, 4, 40, 8)
    model = w.build("autocast")
    assert type(model).__name__ == "GPT2LMHeadModel" and len(model.transformer.h) == 1
    assert model.config.n_embd == 32 and model.get_input_embeddings().num_embeddings == 40
    assert math.isfinite(w.loss(model, w.inputs(rank=1)).item())
    assert "1 layers, hidden 32, 4 heads, vocab 40" in w.describe(1)


def test_a_config_json_and_a_flag_that_disagrees(tmp_path):
    from dcr_bench.harness.workload import Workload, workload_from_args

    path = _gpt2_config_json(tmp_path)
    parse = cli.build_parser().parse_args
    # The config's own value given again is fine; another one, or a --seq past its positions, not.
    assert workload_from_args(parse(["profile", "--model", path, "--layers", "1"]),
                              "profile").layers == 1
    with pytest.raises(SystemExit, match=r"profile: --hidden 64, but .*config\.json has hidden 32"):
        workload_from_args(parse(["profile", "--model", path, "--hidden", "64"]), "profile")
    with pytest.raises(SystemExit, match=r"--seq 64 is past .*config\.json's max_position"):
        workload_from_args(parse(["profile", "--model", path, "--seq", "64"]), "profile")
    with pytest.raises(ValueError, match="config.json has"):  # a Workload built by hand
        Workload(model=path).build("autocast")


@pytest.mark.parametrize("content,says", [
    (None, "neither a transformers preset"),
    ("{not json", "not valid JSON"),
    ('{"n_layer": 1}', '"model_type"'),
])
def test_a_bad_config_path_is_an_error_naming_the_file(tmp_path, content, says):
    """Before any rank process starts: the error names the file and what is wrong with it."""
    from dcr_bench.harness import models

    path = tmp_path / "my-config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit, match="deepcompile-remat compare: --model .*my-config.json"
                                         f".*{re.escape(says)}"):
        cli.main(["compare", "--model", str(path)])
    with pytest.raises(ValueError, match=f"my-config.json.*{re.escape(says)}"):
        models.build_hf(str(path))


def test_profile_transformers_preset_shows_progress_and_table_only(tmp_path):
    """`profile --model llama` through the console command, as a user runs it: the ranks build
    the preset, and stderr holds the progress lines only (no kineto "USDT ... profiler_start",
    no library warnings: a user sees the progress line and the table)."""
    import subprocess
    import sys

    pytest.importorskip("transformers")
    proc = subprocess.run(
        [sys.executable, "-m", "dcr_bench.cli", "profile", "--model", "llama",
         "--backends", "eager", "--precisions", "autocast", "--setups", "ours", "--layers", "1",
         "--hidden", "64", "--heads", "4", "--vocab", "64", "--seq", "16", "--steps", "1",
         "--warmup", "0", "--profiled-steps", "1", "--no-plots", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    progress = [line for line in proc.stderr.splitlines() if line.strip()]
    prefix = "profile [1/1] eager/autocast/ours: "
    stray = [line for line in progress if not line.startswith(prefix)]
    assert not stray, stray[:10]
    assert any("profiling step 1/1" in line for line in progress)
    assert "USDT" not in proc.stdout and "Warning" not in proc.stdout
    assert proc.stdout.startswith("llama 1 layers, hidden 64, 4 heads, vocab 64")
    assert re.search(r"^eager/autocast/ours +\d", proc.stdout, re.M), proc.stdout
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["meta"]["workload"]["model"] == "llama"
    rows = data["rows"]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    assert all(r["peak_bytes"] > 0 and r["gathered_bytes"] > 0 for r in rows)
