"""Activation checkpointing under our partitioner, against torch's on the same graphs.

Every op of a checkpoint region is tagged PREFER_RECOMPUTE (torch.utils.checkpoint, either
use_reentrant; HF's activation_checkpointing_enable) or tagged by a selective-checkpointing
policy; SDPA carries Tag.nondeterministic_seeded even at dropout_p=0. Each case compiles the
same model from the same seed twice, with our partitioner and with torch's
min_cut_rematerialization_partition (RematConfig(enabled=False)), and requires: the same loss,
outputs and gradients, no parameter copy saved for the backward (an independent graph walk),
and no more saved activation bytes than torch's.

SDPA's CPU flash kernel has no dropout (torch itself raises "No available kernel"), so flash
runs without dropout and dropout runs on the math kernel.
"""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import deepcompile_remat as dcr
from deepcompile_remat import RematConfig
from deepcompile_remat.backends import parameter_indices_of
from deepcompile_remat.fx_values import value_bytes
from graph_checks import parameter_copies_saved

BACKENDS = ["eager", "inductor"]
TORCH = RematConfig(enabled=False)


class SdpaBlock(nn.Module):
    """Pre-norm attention with F.scaled_dot_product_attention and residual dropout."""

    def __init__(self, d=32, heads=4, dropout=0.0):
        super().__init__()
        self.ln, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.heads, self.dropout = heads, dropout

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, t, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)
        x = x + F.dropout(self.proj(y.transpose(1, 2).reshape(b, t, d)), self.dropout)
        return x + self.mlp(x)


class CheckpointedStack(nn.Module):
    def __init__(self, blocks, checkpoint_kwargs):
        super().__init__()
        self.blocks, self.checkpoint_kwargs = nn.ModuleList(blocks), checkpoint_kwargs

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, **self.checkpoint_kwargs)
        return x


def _save_matmuls(ctx, op, *args, **kwargs):
    return (CheckpointPolicy.MUST_SAVE if op in (torch.ops.aten.mm.default,
                                                 torch.ops.aten.addmm.default)
            else CheckpointPolicy.PREFER_RECOMPUTE)


def _recompute_everything(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_RECOMPUTE


CHECKPOINTS = {
    "non-reentrant": dict(use_reentrant=False),
    "reentrant": dict(use_reentrant=True),
    "sac-save-matmuls": dict(use_reentrant=False, context_fn=functools.partial(
        create_selective_checkpoint_contexts, _save_matmuls)),
    "sac-must-recompute": dict(use_reentrant=False, context_fn=functools.partial(
        create_selective_checkpoint_contexts, _recompute_everything)),
}
ATTENTION = {"math": (SDPBackend.MATH, 0.0), "math-dropout": (SDPBackend.MATH, 0.3),
             "flash": (SDPBackend.FLASH_ATTENTION, 0.0)}


def saved_activation_bytes(fw, bw, parameter_names) -> int:
    """Bytes the backward receives from the forward, parameters (live anyway) excepted; RNG
    states replayed for recomputed random ops included."""
    total = 0
    for n in bw.graph.find_nodes(op="placeholder"):
        if n.name.startswith(("tangents", "bwd_seed", "bwd_base_offset")):
            continue
        if n.name not in parameter_names:
            total += value_bytes(n.meta.get("val"))
    return int(total)


def compiled_step(build, run, kind, config):
    """build() -> model; run(compiled_model) -> (loss, outputs). Same seeds every call. Returns
    (loss, outputs, gradients, [(fw, bw, parameter names)])."""
    torch.manual_seed(0)
    model = build()
    graphs = []

    def observe(fw, bw, example_inputs):
        primals = [n.name for n in fw.graph.find_nodes(op="placeholder")]
        graphs.append((fw, bw, {primals[i] for i in parameter_indices_of(example_inputs)}))

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=dcr.backend(kind, config, on_partition=observe))
    torch.manual_seed(1)  # the dropout draws
    loss, outputs = run(compiled)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), outputs.detach(), grads, graphs


def _dropout_p(node) -> object:
    """The dropout_p a seeded op is called with (None: it has no such argument). SDPA carries
    the random tag for its dropout; with dropout_p == 0 it draws nothing, and running it again
    in the backward is an ordinary recomputation."""
    from torch.fx.operator_schemas import normalize_function

    got = normalize_function(node.target, node.args, node.kwargs,
                             normalize_to_only_use_kwargs=True)
    if got is None or "dropout_p" not in got.kwargs:
        return None
    return got.kwargs["dropout_p"]


# Inductor fuses our graph and torch's into different kernels (our CSE keeps checkpoint
# regions' duplicates apart, torch's merges them): last-bit differences, in fp32 below 1e-5;
# under bf16 autocast a different fusion rounds bf16 intermediates differently (torch 2.11:
# up to 4e-4 on an embedding gradient), so there the tolerance is bf16's.
FUSED_FP32_TOL = dict(rtol=1e-5, atol=1e-6)
FUSED_BF16_TOL = dict(rtol=1.6e-2, atol=1e-3)


def assert_same_as_torch(build, run, kind, *, exact, fused_tol=FUSED_FP32_TOL):
    """Ours against torch's partitioner: equal numerics, no parameter copy saved, no more
    saved activation bytes, no random op drawn anew in a backward. Returns our reports."""
    dcr.clear_reports()
    loss, out, grads, graphs = compiled_step(build, run, kind, RematConfig())
    reports = dcr.reports()
    assert reports, "our partitioner did not run"
    ref_loss, ref_out, ref_grads, ref_graphs = compiled_step(build, run, kind, TORCH)
    tol = dict(rtol=0, atol=0) if exact else fused_tol
    torch.testing.assert_close(loss, ref_loss, **tol)
    torch.testing.assert_close(out, ref_out, **tol)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], **tol, msg=lambda m: f"{name}: {m}")
    assert len(graphs) == len(ref_graphs)
    for (fw, bw, names), (rfw, rbw, rnames) in zip(graphs, ref_graphs):
        assert parameter_copies_saved(fw, bw, names) == []
        # These backwards draw nothing of their own: a seeded random op there is a forward op
        # run again, and only run_with_rng_state (the forward's state replayed) may run it.
        drawn = [n.name for n in bw.graph.nodes if n.op == "call_function"
                 and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
                 and _dropout_p(n) != 0]
        assert drawn == [], f"random ops drawn anew in the backward: {drawn}"
        ours, theirs = saved_activation_bytes(fw, bw, names), saved_activation_bytes(
            rfw, rbw, rnames)
        assert ours <= theirs, f"ours saves {ours} activation bytes, torch's {theirs}"
    return reports


# Eager: every checkpoint mode with every attention kernel. Inductor (20-60 s a case on a cold
# kernel cache): each non-reentrant mode and each kernel at least once; use_reentrant traces
# to the same graph as not (the eager cases show it), so it has no inductor case of its own.
REGION_CASES = [("eager", m, a) for m in CHECKPOINTS for a in ATTENTION] + [
    ("inductor", "non-reentrant", "math"), ("inductor", "non-reentrant", "math-dropout"),
    ("inductor", "non-reentrant", "flash"), ("inductor", "sac-must-recompute", "math-dropout"),
    ("inductor", "sac-save-matmuls", "flash")]


@pytest.mark.parametrize("kind,mode,attention", REGION_CASES)
def test_checkpoint_regions_match_torch(kind, mode, attention):
    """Before: every region holding SDPA failed to compile (PartitionConflictError: a random
    op that could be neither saved, being a tuple, nor recomputed). Regions are recomputed as
    asked; a random op in one is recomputed with its forward RNG state replayed."""
    sdpa_backend, p = ATTENTION[attention]
    kwargs = CHECKPOINTS[mode]

    def build():
        return CheckpointedStack([SdpaBlock(dropout=p) for _ in range(2)], kwargs)

    def run(model):
        x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2))
        with sdpa_kernel(sdpa_backend):
            y = model(x)
        return y.square().mean(), y

    # Inductor fuses our graphs and torch's into different kernels: last-bit differences.
    reports = assert_same_as_torch(build, run, kind, exact=kind == "eager")
    rep = reports[-1]
    # Whatever saves the region's matmuls is a policy; everything else recomputes them.
    recomputed_mm = any(r.startswith(("mm", "addmm")) for r in rep.recomputed)
    assert recomputed_mm == (mode != "sac-save-matmuls"), rep.recomputed


@pytest.mark.parametrize("kind", BACKENDS)
def test_dropout_recomputed_in_a_region_uses_the_forward_mask(kind):
    """Independent of torch: the gradient of sum(dropout(x W^T)) is 2 * mask @ W with the
    mask the forward drew; a recomputed dropout that drew anew would give another mask."""
    fc = nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)

    def f(x):
        return checkpoint(lambda x: F.dropout(fc(x), p=0.5, training=True), x,
                          use_reentrant=False)

    out = torch.compile(f, backend=dcr.backend(kind))(x)
    out.sum().backward()
    mask = (out.detach() != 0).to(torch.float32)
    assert 0.3 < mask.mean() < 0.7
    torch.testing.assert_close(x.grad, (mask * 2.0) @ fc.weight.detach(), rtol=1e-5, atol=1e-5)
    # The region was recomputed: its random draw is in the backward (eager: native_dropout
    # replayed; inductor: its seeded inductor_random).
    recomputed = dcr.reports()[-1].recomputed
    assert any("RNG replayed" in r or "random" in r for r in recomputed), recomputed


_TALLY_CALLS = [0]


@torch.library.custom_op("dcr_test::tally_in_region", mutates_args=())
def _tally(x: torch.Tensor) -> torch.Tensor:
    _TALLY_CALLS[0] += 1  # the side effect: once per forward, never again in the backward
    return x * 2


_tally.register_fake(lambda x: torch.empty_like(x))
_tally.register_autograd(lambda ctx, g: g * 2)


@pytest.mark.parametrize("kind", BACKENDS)
def test_effectful_op_in_a_region_yields_the_request(kind):
    """An effectful op cannot be replayed: the region's request to recompute it yields (its
    result is saved, the effect happens once) and the report names what was saved against
    the request, where a hard rule would have been a conflict."""
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

    handle = _register_effectful_op(torch.ops.dcr_test.tally_in_region.default,
                                    _EffectType.ORDERED)
    try:
        x = torch.randn(64, requires_grad=True)
        _TALLY_CALLS[0] = 0

        def f(x):
            return checkpoint(lambda x: (_tally(x.sin()).cos() * x).sum(), x,
                              use_reentrant=False)

        torch.compile(f, backend=dcr.backend(kind))(x).backward()
        assert _TALLY_CALLS[0] == 1
        rep = dcr.reports()[-1]
        assert rep.saved_against_request, rep
        assert not any("with_effects" in op for op in rep.backward_ops)
        ref = x.detach().clone().requires_grad_()
        (torch.cos(2 * ref.sin()) * ref).sum().backward()
        torch.testing.assert_close(x.grad, ref.grad)
    finally:
        if handle is not None:
            handle.destroy()


# --- transformers models with HF's own activation checkpointing ----------------------------------

# Eager: each preset, both use_reentrant, with and without autocast. Inductor (20-30 s a case
# at 2 layers): one layer of llama and of gpt2 (its dropout), under autocast, and of qwen2 with
# use_reentrant=True (the autograd.Function form of checkpoint), without.
# Under inductor, one case per flag pair: llama's non-reentrant autocast case repeated gpt2's
# (test_hf_training.py runs llama with checkpointing under inductor on 2 ranks).
HF_CASES = [(p, "eager", 2, reentrant, not reentrant) for p in ("llama", "qwen2", "gpt2")
            for reentrant in (False, True)] + [
    ("gpt2", "inductor", 1, False, True), ("qwen2", "inductor", 1, True, False)]


@pytest.mark.parametrize("preset,kind,layers,reentrant,autocast", HF_CASES)
def test_hf_activation_checkpointing_matches_torch(preset, kind, layers, reentrant, autocast):
    """Before: model.gradient_checkpointing_enable() on any of these failed to compile under
    dcr.backend (SDPA in every region). gpt2 also has dropout (0.1) in every region."""
    from dcr_bench.harness import models
    pytest.importorskip("transformers")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))

    def build():
        model = models.build_hf(preset, layers=layers, hidden=64)
        models.enable_hf_checkpointing(model, use_reentrant=reentrant)
        return model

    def run(model):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=ids, labels=ids)
        return out.loss, out.logits

    assert_same_as_torch(build, run, kind, exact=kind == "eager",
                         fused_tol=FUSED_BF16_TOL if autocast else FUSED_FP32_TOL)


def test_hf_deprecated_gradient_checkpointing_enable_compiles():
    """The name the issue reported, still what older code calls."""
    from dcr_bench.harness import models
    pytest.importorskip("transformers")
    model = models.build_hf("llama", layers=1, hidden=64)
    with pytest.warns(FutureWarning):
        model.gradient_checkpointing_enable()
    ids = torch.randint(0, 128, (2, 8))
    torch.compile(model, backend=dcr.backend("eager"))(input_ids=ids, labels=ids).loss.backward()
    rep = dcr.reports()[0]
    assert any("flash_attention" in r or "rng" in r for r in rep.recomputed), rep.recomputed
