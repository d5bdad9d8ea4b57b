"""Smoke tests of `deepcompile-remat bench-partition`'s end-to-end rows and compile share, at
tiny sizes (2-layer graphs, one repetition)."""
from __future__ import annotations

import json

import pytest

from dcr_bench import cli
from deepcompile_remat.partition import extract_fast

# Ours' extraction where this torch's layout allows it (2.13); on 2.11 every graph takes
# torch's, and the row says so.
OURS_PATH = "ours" if extract_fast.torch_layout_supported() else "torch"


def test_end_to_end_rows_torch_before_and_ours(capsys):
    """Per graph: torch's whole call, ours "before" (torch's DCE, CSE and extraction) and ours,
    with our phases; the before switch is off again afterwards."""
    pytest.importorskip("transformers")
    assert cli.main(["bench-partition", "--layers", "--tiny", "--reps", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["depth_sweep"] == []
    rows = data["end_to_end"]
    assert [(r["graph"], r["partitioner"]) for r in rows] == [
        (g, p) for g in ("gpt24", "llama16") for p in ("torch", "ours before", "ours")]
    for r in rows:
        assert r["ms"] > 0 and r["nodes"] > 0 and r["spread_ms"][0] <= r["spread_ms"][1]
        if r["partitioner"] == "torch":
            assert r["vs_torch"] == 1.0
            continue
        assert r["prepare_ms"] > 0 and r["export_ms"] > 0 and r["extract_ms"] > 0
        want = "torch" if r["partitioner"] == "ours before" else OURS_PATH
        assert r["extract_path"].startswith(want), r["extract_path"]
        if r["extract_path"] == "ours":
            assert r["build_ms"] > 0


def test_end_to_end_table(capsys):
    assert cli.main(["bench-partition", "--layers", "--graphs", "gpt24", "--tiny",
                     "--reps", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["graph", "partitioner", "nodes", "ms", "vs"]
    assert [line.split()[1] for line in lines[1:]] == ["torch", "ours", "ours"]
    if OURS_PATH == "ours":
        assert lines[-1].split()[-1] == "ours"
    else:
        assert "lays out saved values differently" in lines[-1]


def test_compile_share_before_and_after(capsys):
    assert cli.main(["bench-partition", "--compile-share", "eager", "--graphs", "gpt24",
                     "--tiny", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["graph"], row["backend"]) == ("gpt24", "eager")
    for phase in ("before", "after"):
        assert row[phase]["partition_ms"] > 0 and row[phase]["compile_ms"] > 0
        assert row[phase]["share"] == pytest.approx(
            row[phase]["partition_ms"] / row[phase]["compile_ms"])
