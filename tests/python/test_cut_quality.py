"""Our cut against torch's min-cut, one process, no ZeRO-3, on transformers' own architectures
(issue 27, items 2 and 4): the backward recomputes no compute-intensive op and no shrinking
reduction that torch's does not, with and without HF's activation checkpointing, and the step's
peak is no higher. Compile caches are off (cut_quality.compiled_step: a warm cache would skip
both partitioners)."""
import collections

import pytest

pytest.importorskip("transformers")

from dcr_bench.harness.steady_malloc import steady_cpu_malloc  # noqa: E402
from dcr_bench.profile.cut_quality import (  # noqa: E402
    compiled_step, measure, measure_pair, verdicts)

# What a backward spends its time in: matmuls, convolutions, attention (torch wraps a
# recomputed attention in run_with_rng_state; ours runs it bare when it draws nothing).
COMPUTE = ("mm", "bmm", "addmm", "baddbmm", "convolution", "_scaled_dot_product",
           "run_with_rng_state")
REDUCTIONS = ("sum", "mean", "var", "var_mean", "amax", "amin", "logsumexp")


def _backward_ops(arch, enabled, precision="fp32", checkpointing=False):
    backwards = []
    step = compiled_step(arch, "ours" if enabled else "torch", "eager", precision,
                         checkpointing=checkpointing,
                         on_partition=lambda fw, bw, _: backwards.append(bw))
    step()
    ops = collections.Counter()
    for bw in backwards:
        for n in bw.graph.nodes:
            if n.op == "call_function":
                ops[getattr(n.target, "__name__", str(n.target)).split(".")[0]] += 1
    return ops


def _of(ops, names, exact=False):
    return {k: v for k, v in ops.items()
            if any(k == n if exact else k.startswith(n) for n in names)}


@pytest.mark.parametrize("arch,precision", [("t5", "fp32"), ("llama", "bf16"), ("bert", "fp32")])
def test_norm_statistics_are_saved_not_recomputed(arch, precision):
    """Silent cost guarded (issue 27 item 4): a byte-only cut recomputed every norm's
    statistics in the backward (T5's RMSNorm: 12 means a step), because saving a few bytes
    looked better than nothing, paying a full pass over the norm's input and a higher backward
    peak. Ours now recomputes no reduction torch's partitioner does not, and the same
    matmuls and attention."""
    theirs, ours = _backward_ops(arch, False, precision), _backward_ops(arch, True, precision)
    assert _of(ours, COMPUTE) == _of(theirs, COMPUTE), (_of(ours, COMPUTE), _of(theirs, COMPUTE))
    extra = collections.Counter(_of(ours, REDUCTIONS, exact=True)) - collections.Counter(
        _of(theirs, REDUCTIONS, exact=True))
    assert not extra, f"reductions only ours recomputes: {dict(extra)}"


def test_hf_llama_with_checkpointing_recomputes_what_torch_recomputes():
    """Issue 27 item 2: on the regions HF's gradient checkpointing tags, ours recomputes the
    matmuls and the attention torch's partitioner recomputes (SDPA once per layer, bare or in
    run_with_rng_state), and no reduction more. What ours recomputes besides is cheap
    pointwise work (the causal mask, which torch saves)."""
    theirs = _backward_ops("llama", False, "bf16", checkpointing=True)
    ours = _backward_ops("llama", True, "bf16", checkpointing=True)
    mm = ("mm", "bmm", "addmm")
    assert _of(ours, mm) == _of(theirs, mm)
    attention = ("_scaled_dot_product", "run_with_rng_state")
    assert sum(_of(ours, attention).values()) == sum(_of(theirs, attention).values())
    extra = collections.Counter(_of(ours, REDUCTIONS, exact=True)) - collections.Counter(
        _of(theirs, REDUCTIONS, exact=True))
    assert not extra, f"reductions only ours recomputes: {dict(extra)}"
    assert sum(ours.values()) - sum(theirs.values()) < 0.1 * sum(theirs.values())


@pytest.mark.parametrize("kind", ["eager", "inductor"])
def test_peak_no_higher_than_torchs_on_t5(kind):
    """The T5 class (RMSNorm) whose backward peak the recomputed norms raised: ours' step
    peak is at most torch's (memory is deterministic here: the allocator's own total). Under
    inductor it was 3.3% higher until ties among minimum cuts went to the one nearest the
    backward (remat_partition.h, Solve): the source-side cut recomputed more of each block
    in the backward."""
    theirs, ours = measure_pair("t5", kind, "fp32", steps=1, rounds=1)  # peaks, not times
    assert (theirs["partitioner"], ours["partitioner"]) == ("torch", "ours")
    assert ours["peak_bytes"] <= theirs["peak_bytes"] * 1.02, (ours, theirs)


def _saved_weights(partitioner):
    """(full-precision conv weights k x k > 1x1, bf16 ones) among the values the forward saves
    for the backward of a basic-block HF ResNet, inductor, bf16 autocast."""
    import torch

    backwards = []
    step = compiled_step("resnet-basic", partitioner, "inductor", "bf16",
                         on_partition=lambda fw, bw, _: backwards.append(bw))
    step()
    weights = collections.Counter()
    for bw in backwards:
        for n in bw.graph.find_nodes(op="placeholder"):
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dim() == 4 and val.shape[2:] != (1, 1) \
                    and val.shape[0] != 4:  # weights (out, in, k, k), not batch-4 activations
                weights[val.dtype] += 1
    return weights[torch.float32], weights[torch.bfloat16]


def test_conv_weights_are_saved_as_their_bf16_casts_under_inductor():
    """Issue 43 item 7: under inductor, a conv net's forward is laid out channels-last, and a
    weight the forward saves is written out as a channels-last copy (partition/layouts.py). Ours
    recomputed each weight's bf16 cast from the saved fp32 weight, so each weight was held as
    an fp32 copy: a basic-block ResNet's step peak was 27% above torch's at 64x64, which saves
    the bf16 casts. The cut now prices the copy and saves what torch's saves."""
    # torch's cut saves the same: the 7x7 stem's cast and the eight 3x3 convs' (2026-11-28)
    assert _saved_weights("ours") == (0, 9)


def test_side_by_side_peaks_are_each_steps_own():
    """cut-quality times torch's step and ours side by side, both compiled in one process
    (measure_pair): each peak must still be its own step's, exactly what measure finds with
    the step alone in its process (the allocator's count is deterministic here)."""
    assert steady_cpu_malloc()  # glibc: both thresholds fixed
    pair = measure_pair("bert", "eager", "fp32", steps=1, rounds=2)
    alone = [measure("bert", which, "eager", "fp32", steps=1) for which in ("torch", "ours")]
    assert [r["peak_bytes"] for r in pair] == [r["peak_bytes"] for r in alone]
    assert pair[1]["peak_bytes"] < pair[0]["peak_bytes"]  # the cuts differ: ours saves less


def test_verdicts_mark_a_loss_only_beyond_the_tolerance():
    rows = [dict(arch="a", kind="inductor", precision="fp32", partitioner=p, peak_bytes=b,
                 step_s=s, cpu_s=s) for p, b, s in (("torch", 100.0, 1.0), ("ours", 101.0, 1.2))]
    (line,) = verdicts(rows, peak_tolerance=0.02, time_tolerance=0.10)
    assert line["losses"] == ["time"]
    assert abs(line["peak_ratio"] - 1.01) < 1e-9
    (line,) = verdicts(rows, peak_tolerance=0.0, time_tolerance=0.5)
    assert line["losses"] == ["peak"]
