"""`deepcompile-remat frontier`'s parts that decide what it reports: the points it runs, the
Pareto front, and the measured floor of one layer."""
import pytest

from dcr_bench.harness.workload import Workload
from dcr_bench.profile.frontier import SETTINGS, layer_floor, pareto_front, points


def test_the_front_keeps_exactly_the_points_nothing_beats():
    rows = [{"label": "a", "peak": 10, "step_s": 1.0},   # lowest peak
            {"label": "b", "peak": 20, "step_s": 0.5},   # fastest
            {"label": "c", "peak": 15, "step_s": 0.8},   # between: kept
            {"label": "d", "peak": 20, "step_s": 0.9},   # beaten by c on both
            {"label": "e", "peak": 10, "step_s": 1.2},   # ties a on peak, slower: beaten
            {"label": "f", "peak": 15, "step_s": 0.8}]   # equal to c: neither beats the other
    assert [r["label"] for r in pareto_front(rows)] == ["b", "c", "f", "a"]


def test_points_run_every_setting_with_and_without_checkpointing_on_transformers_models():
    hf = Workload(model="llama", layers=2, hidden=64, heads=4, seq=32)
    got = points(hf, {"ours-inductor", "fsdp2-block"})
    labels = [p[0] for p in got]
    ours = ["ours-inductor", "ours-inductor budget 0.5", "ours-inductor budget 0",
            "ours-inductor peak 1.0", "ours-inductor peak 0.85"]
    assert labels == [*ours, "fsdp2-block", *(f"{o} +ckpt" for o in ours), "fsdp2-block +ckpt"]
    assert [p[3].checkpointing for p in got] == [False] * 6 + [True] * 6
    assert [p[2] for p in got[:5]] == [{}, {"memory_budget": 0.5}, {"memory_budget": 0.0},
                                       {"peak_target": 1.0}, {"peak_target": 0.85}]
    # The built-in GPT has no HF checkpointing: only the plain points.
    assert all(not p[3].checkpointing for p in points(Workload(), {s for _, s, _ in SETTINGS}))


@pytest.mark.parametrize("precision", ["autocast", "bf16"])
def test_the_layer_floor_grows_with_the_sequence_and_counts_the_weights(precision):
    """The one-layer working set is measured, not assumed: at 4x the tokens a llama layer's
    forward-and-backward holds more (activations, their gradients, attention scores); its
    16-bit weights are the layer's parameters at 2 bytes each."""
    short = layer_floor(Workload(model="llama", layers=2, hidden=64, heads=4, seq=32), precision)
    long = layer_floor(Workload(model="llama", layers=2, hidden=64, heads=4, seq=128), precision)
    assert short["layer"] == "LlamaDecoderLayer"
    assert 0 < short["layer_working_set_bytes"] < long["layer_working_set_bytes"]
    assert long["layer_working_set_bytes"] > 2 * short["layer_working_set_bytes"]
    assert short["layer_weights_16bit_bytes"] == long["layer_weights_16bit_bytes"] > 0
