"""`deepcompile-remat traffic`: the per-rank bytes a step moves, and those crossing node
boundaries, traced from the graphs the runtime compiles (a meta model under torch's fake
process group) and checked against the closed form of ZeRO-3 / ZeRO++ hpZ / HSDP.

Each trace runs in a process of its own (harness.ranks.spawn_for_rows, one process): it owns
the process's torch.distributed state and dynamo caches.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dcr_bench.harness.ranks import spawn_for_rows
from dcr_bench.traffic import ring

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(layers=2, hidden=64, vocab=128, heads=4, kv_heads=2)  # the harness's llama preset
WORLD, NODE = 8, 4


def _measure(_rank, precision="fp32", marking=True, extrapolate=False, layers=2,
             layouts=("zero3", "hpz", "hsdp")):
    from dcr_bench.harness.models import hf_config
    from dcr_bench.traffic.command import measure

    cfg = hf_config("llama", **{**SMALL, "layers": layers})
    return measure(cfg, WORLD, NODE, precision, layouts, extrapolate, marking)


def _measure_kw(rank, kw):
    return _measure(rank, **kw)


def _rows(**kw) -> dict:
    """(layout, phase) -> row of command.measure on the small Llama, traced in a process of
    its own."""
    rows = spawn_for_rows(_measure_kw, 1, kw, timeout_s=600)
    return {(r["layout"], r["phase"]): r for r in rows}


def test_ring_model_counts_the_hops_that_leave_a_node():
    """Guards the ring model itself: a ring over all ranks leaves each node once, a ring
    within a node never, a ring over one rank per node at every hop; an all-reduce sends twice
    an all-gather's bytes. A wrong node-of-rank or successor would move bytes between columns."""
    ranks = ring.Ranks(8, 4)
    sent, crossing = ring.ring_sends("all_gather", 800.0, ranks.groups("world"), ranks)
    assert np.allclose(sent, 700.0)
    assert crossing.nonzero()[0].tolist() == [3, 7] and np.allclose(crossing[[3, 7]], 700.0)
    sent, crossing = ring.ring_sends("reduce_scatter", 400.0, ranks.groups("node"), ranks)
    assert np.allclose(sent, 300.0) and not crossing.any()
    sent, crossing = ring.ring_sends("all_reduce", 100.0, ranks.groups("replica"), ranks)
    assert np.allclose(sent, 100.0) and np.allclose(crossing, sent)  # 2 (N-1)/N with N = 2
    assert ranks.groups("replica") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="multiple of the node size"):
        ring.Ranks(8, 3)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_traced_traffic_equals_the_closed_form(precision):
    """Guards the traffic table against either side drifting: the bytes the compiled graphs
    move (every gather, backward re-gather and reduce-scatter, with their padding and dtype)
    must equal the formulas from the parameter counts, per phase and layout, and the
    structure must be ZeRO++'s: hpZ's re-gathers and all of HSDP's gathers stay in the node."""
    rows = _rows(precision=precision)
    bad = [k for k, r in rows.items() if not r["agree"]]
    assert not bad, f"traced differs from the closed form in {bad}: " + str(
        [rows[k] for k in bad])
    z_fw, z_bw = rows["zero3", "forward gathers"], rows["zero3", "backward re-gathers"]
    assert z_fw["collectives"] > 0 and z_bw["collectives"] > 0
    # The embedding's gradient does not read it: re-gathered bytes are the forward's less it.
    embed_bytes = SMALL["vocab"] * SMALL["hidden"] * (4 if precision == "fp32" else 2)
    assert z_fw["sent_per_rank"] - z_bw["sent_per_rank"] == pytest.approx(
        (WORLD - 1) / WORLD * embed_bytes)
    assert rows["hpz", "backward re-gathers"]["leaving_node"] == 0
    assert rows["hpz", "forward gathers"]["leaving_node"] == z_fw["leaving_node"] > 0
    for phase in ("forward gathers", "backward re-gathers", "gradient reduce-scatters"):
        assert rows["hsdp", phase]["leaving_node"] == 0
    # Read from the compiled backward of a hybrid-sharded model: the runtime's own all-reduces.
    assert rows["hsdp", "replica all-reduces"]["collectives"] > 0
    assert rows["hsdp", "replica all-reduces"]["leaving_node"] > 0
    # fp32 gradients whatever the gathers: reduce-scatter bytes are 4 per element.
    rs = rows["zero3", "gradient reduce-scatters"]
    if precision == "bf16":
        assert rs["sent_per_rank"] > 1.9 * z_fw["sent_per_rank"]


def test_without_the_marking_the_backward_does_not_regather_and_the_formula_says_so():
    """Guards the check itself: with the ZeRO-3 marking off, the backward keeps the gathered
    weights (no re-gather), so the traced backward phase must disagree with the closed form,
    which counts ZeRO-3's re-gathers; a check that cannot see this would pass anything."""
    rows = _rows(marking=False, layouts=("zero3",))
    bw = rows["zero3", "backward re-gathers"]
    assert bw["sent_per_rank"] < bw["formula_sent_per_rank"] and not bw["agree"]
    assert rows["zero3", "forward gathers"]["agree"]
    assert rows["zero3", "gradient reduce-scatters"]["agree"]


def test_extrapolating_from_one_and_two_layers_is_exact():
    """Guards --extrapolate (how a deep model is traced cheaply): the bytes of every phase at
    3 layers extrapolated from traces at 1 and 2 equal the trace of all 3."""
    traced = _rows(layers=3, layouts=("zero3",))
    extrapolated = _rows(layers=3, layouts=("zero3",), extrapolate=True)
    for key, row in traced.items():
        for figure in ("sent_per_rank", "crossing_per_rank", "leaving_node"):
            assert extrapolated[key][figure] == pytest.approx(row[figure], rel=1e-12), key
        assert extrapolated[key]["agree"]


def test_command_prints_the_table(tmp_path):
    """Guards the command line: `deepcompile-remat traffic` on a config.json prints one row
    per phase and a step total per layout, every one agreeing, and exits 0."""
    from dcr_bench.harness.models import hf_config

    path = tmp_path / "config.json"
    hf_config("llama", **SMALL).to_json_file(str(path))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}"}
    out = subprocess.run(
        [sys.executable, "-m", "dcr_bench", "traffic", "--model", str(path), "--world",
         str(WORLD), "--node-size", str(NODE), "--layouts", "zero3", "hsdp"],
        env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "8 ranks = 2 nodes x 4" in lines[1]
    table = [line for line in lines if line.strip().endswith(("yes", "NO"))]
    assert len(table) == 3 + 1 + 4 + 1 and all(line.endswith("yes") for line in table)
    assert sum("step total" in line for line in table) == 2
