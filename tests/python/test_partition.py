"""The partitioner through torch.compile: the seeds' examples, a model zoo against eager,
ZeRO-3 marking, checkpoint tags, dynamic shapes, determinism and errors."""
import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from functorch.compile import aot_function, make_boxed_func
from torch.utils.checkpoint import CheckpointPolicy

import deepcompile_remat as dcr
from deepcompile_remat import RematConfig
from dcr_bench.harness.models import GPT, MLP, Block, zoo
from graph_checks import capture_partitions, parameter_copies_saved

BACKENDS = ["eager", "inductor"]


def last_report():
    reps = dcr.reports()
    assert reps, "the partitioner did not run"
    return reps[-1]


def compile_and_backward(fn, inputs, kind, config=None):
    out = torch.compile(fn, backend=dcr.backend(kind, config), fullgraph=True)(*inputs)
    out.sum().backward()
    return out


# --- the seeds' examples -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", BACKENDS)
def test_cos_cos_of_sum_saves_only_the_sum(kind):
    xs = [torch.randn(1024, requires_grad=True) for _ in range(4)]
    compile_and_backward(lambda a, b, c, d: torch.cos(torch.cos(a + b + c + d)), xs, kind)
    rep = last_report()
    assert len(rep.saved) == 1 and rep.saved[0].bytes == 1024 * 4, rep.saved
    ref = [x.detach().clone().requires_grad_() for x in xs]
    torch.cos(torch.cos(ref[0] + ref[1] + ref[2] + ref[3])).sum().backward()
    for x, r in zip(xs, ref):
        torch.testing.assert_close(x.grad, r.grad)


@pytest.mark.parametrize("kind", BACKENDS)
def test_random_mask_is_saved_and_never_recomputed(kind):
    x = torch.randn(4096, requires_grad=True)
    out = compile_and_backward(lambda x: x * x * (torch.rand_like(x) < 0.5), [x], kind)
    rep = last_report()
    assert sorted(v.dtype for v in rep.saved) == ["bool", "float32"], rep.saved
    assert not any("rand" in op for op in rep.backward_ops), rep.backward_ops
    mask = out.detach() != 0  # x*x != 0 almost surely, so the output reveals the forward's mask
    assert 0.3 < mask.float().mean() < 0.7
    torch.testing.assert_close(x.grad, 2 * x.detach() * mask)


@pytest.mark.parametrize("kind", BACKENDS)
def test_cos_chain_saves_only_the_input(kind):
    x = torch.randn(2048, requires_grad=True)
    compile_and_backward(lambda x: x.cos().cos().cos(), [x], kind)
    rep = last_report()
    assert [v.name for v in rep.saved] == ["primals_1"], rep.saved
    ref = x.detach().clone().requires_grad_()
    ref.cos().cos().cos().sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)


# --- model zoo against eager ---------------------------------------------------------------------

def run_model(fn, model, inputs, loss_fn, autocast):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = loss_fn(fn(*inputs))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("name", list(zoo()))
def test_model_gradients_match_eager(name, kind, autocast):
    make_model, make_input, loss_fn = zoo()[name]
    model = make_model()
    ref_model = copy.deepcopy(model)
    inputs = [make_input()]
    compiled = torch.compile(model, backend=dcr.backend(kind))
    loss, grads = run_model(compiled, model, inputs, loss_fn, autocast)
    ref_loss, ref_grads = run_model(ref_model, ref_model, inputs, loss_fn, autocast)
    # Same ops in fp32 agree to rounding; under bf16 autocast inductor keeps fused pointwise
    # intermediates in fp32, so the tolerance is that of one bf16 rounding.
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, **tol)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], **tol, msg=lambda m: f"{n}: {m}")
    if name == "conv_bn":  # buffer mutation (running stats) survives partitioning
        torch.testing.assert_close(model.bn.running_mean, ref_model.bn.running_mean, **tol)
    rep = last_report()
    assert rep.graph_nodes > 0
    # conservative policy never recomputes compute-intensive ops
    assert not any(r.startswith(("mm", "addmm", "bmm", "convolution")) for r in rep.recomputed), \
        rep.recomputed


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", BACKENDS)
def test_dropout_gradient_uses_the_forward_mask(kind, autocast):
    fc = nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)

    def f(x):
        return F.dropout(fc(x), p=0.5, training=True)

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = torch.compile(f, backend=dcr.backend(kind))(x)
    out.float().sum().backward()
    mask = (out.detach() != 0).to(torch.float32)
    assert 0.3 < mask.mean() < 0.7
    w = fc.weight.detach().to(out.dtype).float()
    expected = (mask * 2.0) @ w  # d(sum dropout(x W^T + b))/dx with the forward's own mask
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, expected, **tol)
    assert not any("rand" in op for op in last_report().backward_ops)


# --- effectful ops ---------------------------------------------------------------------------

_TALLY_CALLS = [0]


@torch.library.custom_op("dcr_test::tally", mutates_args=())
def _tally(x: torch.Tensor) -> torch.Tensor:
    _TALLY_CALLS[0] += 1  # the side effect: must happen once per forward, never in backward
    return x * 2


_tally.register_fake(lambda x: torch.empty_like(x))
_tally.register_autograd(lambda ctx, g: g * 2)


@pytest.mark.parametrize("kind", BACKENDS)
def test_effectful_op_runs_once_under_aggressive(kind):
    """An effectful op (wrapped in with_effects) recomputed in the backward repeats its side
    effect; under aggressive nothing but the policy stood in the way."""
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

    handle = _register_effectful_op(torch.ops.dcr_test.tally.default, _EffectType.ORDERED)
    try:
        x = torch.randn(64, requires_grad=True)
        _TALLY_CALLS[0] = 0
        f = lambda x: (_tally(x.sin()).cos() * x).sum()  # noqa: E731
        compile_and_backward(f, [x], kind, RematConfig(policy="aggressive"))
        assert _TALLY_CALLS[0] == 1
        assert not any("with_effects" in op for op in last_report().backward_ops)
        ref = x.detach().clone().requires_grad_()
        (torch.cos(2 * ref.sin()) * ref).sum().backward()
        torch.testing.assert_close(x.grad, ref.grad)
    finally:
        if handle is not None:  # older torch returns no handle
            handle.destroy()


@pytest.mark.parametrize("kind", BACKENDS)
def test_parameters_found_when_effect_tokens_shift_the_primals(kind):
    """An effectful op adds a token primal ahead of the graph inputs, so the backend's
    nn.Parameter indices no longer name the right primals; the weight's bf16 copy must still
    be marked, not the token or the activation."""
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

    handle = _register_effectful_op(torch.ops.dcr_test.tally.default, _EffectType.ORDERED)
    try:
        lin = nn.Linear(16, 16)
        x = torch.randn(4, 16)
        with capture_partitions() as graphs, torch.autocast("cpu", dtype=torch.bfloat16):
            out = torch.compile(lambda x: _tally(lin(x)).relu(), backend=dcr.backend(kind),
                                fullgraph=True)(x)
        out.float().sum().backward()
        rep = last_report()
        assert rep.parameter_aliases, rep
        for fw, bw, names in graphs:
            assert len(names) == 2  # weight and bias, found among 4 primals
            assert parameter_copies_saved(fw, bw, names) == []
    finally:
        if handle is not None:
            handle.destroy()


# --- ZeRO-3 marking ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", BACKENDS)
def test_no_saved_value_is_derived_from_a_parameter_under_autocast(kind):
    model = GPT(layers=2)
    idx = torch.randint(0, 64, (2, 16))
    with capture_partitions() as graphs, torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(model, backend=dcr.backend(kind))(idx)
    out.float().mean().backward()
    rep = last_report()
    assert rep.parameter_aliases, "autocast casts of the weights should have been marked"
    saved = {v.name for v in rep.saved}
    assert not saved & set(rep.parameter_aliases), saved & set(rep.parameter_aliases)
    # Independently of the marking: walk every saved value back through views, casts and
    # copies; none may end at a parameter (only the parameter itself may be saved).
    assert graphs and all(len(names) > 20 for _, _, names in graphs)
    for fw, bw, names in graphs:
        assert parameter_copies_saved(fw, bw, names) == []


def capture_partition(fn, inputs, config, *, joint_inputs_empty=False, tag=None):
    """Runs fn through aot_function with our partitioner; returns (out, report)."""
    part = dcr.make_partition_fn(config)

    def partition(joint, joint_inputs, **kw):
        if tag is not None:
            tag(joint)
        return part(joint, [] if joint_inputs_empty else joint_inputs, **kw)

    nop = lambda gm, _: make_boxed_func(gm.forward)  # noqa: E731
    out = aot_function(fn, fw_compiler=nop, bw_compiler=nop, partition_fn=partition)(*inputs)
    out.sum().backward()
    return out, last_report()


def linear_bf16(x, w):
    return (x @ w.to(torch.bfloat16).t()).float().relu()


def test_marking_keeps_the_parameter_not_its_downcast_copy():
    # Without static-lifetime information the weight costs its fp32 bytes, so an unmarked cut
    # prefers the half-size bf16 copy; marking forbids it and the backward re-casts.
    x = torch.randn(8, 256, dtype=torch.bfloat16, requires_grad=True)
    w = nn.Parameter(torch.randn(256, 256))
    with capture_partitions() as graphs:
        _, marked = capture_partition(linear_bf16, [x, w], RematConfig(parameter_indices=[1]))
    assert "primals_2" in {v.name for v in marked.saved}
    assert not {v.name for v in marked.saved} & set(marked.parameter_aliases)
    assert parameter_copies_saved(*graphs[-1]) == []
    grad_marked = w.grad.clone()
    w.grad = None
    with capture_partitions() as graphs:
        _, unmarked = capture_partition(
            linear_bf16, [x, w], RematConfig(parameter_indices=[1], mark_parameter_aliases=False))
    assert any(v.dtype == "bfloat16" and v.shape == (256, 256) for v in unmarked.saved)
    # the independent check sees the leak the marking prevents
    assert len(parameter_copies_saved(*graphs[-1])) == 1
    torch.testing.assert_close(w.grad, grad_marked)


def test_works_with_empty_joint_inputs():
    x = torch.randn(64, requires_grad=True)
    capture_partition(lambda x: x.sin().cos(), [x], RematConfig(), joint_inputs_empty=True)
    torch.testing.assert_close(x.grad, -torch.sin(torch.sin(x.detach())) * torch.cos(x.detach()))


# --- checkpoint tags -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", BACKENDS)
def test_activation_checkpointing_is_honoured(kind):
    torch.manual_seed(1)
    block = Block()
    x = torch.randn(2, 8, 32, requires_grad=True)

    def plain(x):
        return block(x)

    def checkpointed(x):
        return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)

    torch.compile(plain, backend=dcr.backend(kind))(x).sum().backward()
    plain_rep, g_plain = last_report(), x.grad.clone()
    x.grad = None
    torch._dynamo.reset()
    torch.compile(checkpointed, backend=dcr.backend(kind))(x).sum().backward()
    ckpt_rep = last_report()
    torch.testing.assert_close(x.grad, g_plain, rtol=1e-4, atol=1e-5)
    assert ckpt_rep.saved_activation_bytes < plain_rep.saved_activation_bytes
    assert any(r.startswith(("mm", "addmm", "bmm")) for r in ckpt_rep.recomputed)


def _save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in (torch.ops.aten.mm.default,
                                                torch.ops.aten.addmm.default) \
        else CheckpointPolicy.PREFER_RECOMPUTE


def test_selective_checkpoint_must_save_tags():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    fc1, fc2 = nn.Linear(32, 32), nn.Linear(32, 32)
    x = torch.randn(4, 32, requires_grad=True)
    context_fn = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)

    def f(x):
        return torch.utils.checkpoint.checkpoint(
            lambda x: fc2(fc1(x).relu()).relu(), x, use_reentrant=False, context_fn=context_fn)

    torch.compile(f, backend=dcr.backend("eager"))(x).sum().backward()
    rep = last_report()
    assert not any(r.startswith(("mm", "addmm")) for r in rep.recomputed), rep.recomputed
    ref = x.detach().clone().requires_grad_()
    fc2(fc1(ref).relu()).relu().sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)


# --- dynamic shapes ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", BACKENDS)
def test_dynamic_shapes(kind):
    model = MLP()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=dcr.backend(kind), dynamic=True)
    for batch in (3, 7):
        x = torch.randn(batch, 5, 32)
        compiled(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    rep = last_report()
    assert any(not isinstance(s, int) for v in rep.saved for s in v.shape), rep.saved


# --- determinism ---------------------------------------------------------------------------------

def test_same_graph_same_decision():
    block = Block()
    x = torch.randn(2, 8, 32, requires_grad=True)
    joint = {}

    def keep(gm):
        joint["gm"] = copy.deepcopy(gm)

    names, params = zip(*block.named_parameters())

    def f(x, *params):
        return torch.func.functional_call(block, dict(zip(names, params)), (x,))

    capture_partition(f, [x, *params], RematConfig(), tag=keep)
    first = last_report()
    for _ in range(2):
        dcr.partition_fn(copy.deepcopy(joint["gm"]), [], num_fwd_outputs=1)
        assert [v.name for v in last_report().saved] == [v.name for v in first.saved]
        assert last_report().saved_sym_names == first.saved_sym_names


# --- errors --------------------------------------------------------------------------------------

def test_conflicting_tags_name_the_fx_chain():
    def must_save_the_cast(gm):
        for node in gm.graph.nodes:
            if node.target == torch.ops.aten._to_copy.default and node.args[0].name == "primals_2":
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                node.meta["ac_graph_id"] = 0

    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    w = nn.Parameter(torch.randn(64, 64))
    with pytest.raises(dcr.PartitionConflictError) as err:
        capture_partition(linear_bf16, [x, w], RematConfig(parameter_indices=[1]),
                          tag=must_save_the_cast)
    msg = str(err.value)
    assert "_to_copy" in msg and "MUST_SAVE" in msg and "ZeRO-3" in msg, msg


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="policy"):
        RematConfig(policy="agressive")
    with pytest.raises(ValueError, match="'polcy'"):
        RematConfig.from_dict({"polcy": "aggressive"})
    with pytest.raises(ValueError, match=r"parameter_indices\[1\]"):
        RematConfig(parameter_indices=[0, -1])
    with pytest.raises(ValueError, match=r"RematConfig.backend must be one of .*'eagr'"):
        dcr.backend("eagr")
    with pytest.raises(TypeError, match="RematConfig"):
        dcr.make_partition_fn({"policy": "aggressive"})


def test_aggressive_policy_recomputes_more():
    model = GPT(layers=2)
    idx = torch.randint(0, 64, (2, 16))
    results = {}
    for policy in ("conservative", "aggressive"):
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        torch.compile(m, backend=dcr.backend("eager", RematConfig(policy=policy)))(idx).mean().backward()
        results[policy] = last_report()
    assert results["aggressive"].saved_activation_bytes <= results["conservative"].saved_activation_bytes
    assert not any(r.startswith(("mm", "addmm", "bmm")) for r in results["aggressive"].recomputed)


def test_deepspeed_config_block(tmp_path):
    from pathlib import Path

    from deepcompile_remat.deepspeed import config_from_deepspeed

    repo_config = Path(__file__).resolve().parents[2] / "configs" / "zero3_remat.json"
    cfg = config_from_deepspeed(repo_config)
    assert cfg == RematConfig(policy="conservative", bucket_bytes=65536, backend="inductor")
    off = RematConfig(enabled=False)
    assert config_from_deepspeed({"zero_optimization": {"stage": 3}}) == off
    assert config_from_deepspeed({"deepcompile_remat": {"enabled": False}}) == off
    bad = tmp_path / "ds.json"
    bad.write_text('{"deepcompile_remat": {"enabled": true, "polcy": "aggressive"}}')
    with pytest.raises(ValueError, match=r"ds.json: deepcompile_remat: unknown key 'polcy'"):
        config_from_deepspeed(bad)
    # a disabled block is validated too: the typo must not wait until it is switched on
    with pytest.raises(ValueError, match=r"unknown key 'polcy'"):
        config_from_deepspeed({"deepcompile_remat": {"enabled": False, "polcy": "x"}})
    with pytest.raises(ValueError, match=r"deepcompile_remat: RematConfig.enabled must be true "
                                         r"or false, got 'no'"):
        config_from_deepspeed({"deepcompile_remat": {"enabled": "no"}})


@pytest.mark.parametrize("kind", ["eager", "inductor"])
def test_disabled_config_is_off(kind):
    """"enabled": false used to become None, and backend(kind, None) then applied the default
    config: disabled was on. Off must mean torch's partitioner: ours never runs."""
    from deepcompile_remat.deepspeed import config_from_deepspeed

    cfg = config_from_deepspeed({"deepcompile_remat": {"enabled": False}})
    model, x = nn.Linear(16, 16), torch.randn(4, 16)
    out = torch.compile(model, backend=dcr.backend(kind, cfg))(x)
    out.sum().backward()
    assert dcr.reports() == []
    out = torch.compile(copy.deepcopy(model), backend=dcr.backend(kind, RematConfig()))(x)
    out.sum().backward()
    assert len(dcr.reports()) == 1


def test_disabled_config_partitions_with_torch():
    """The public make_partition_fn honours "enabled": false too (it ran ours)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    assert dcr.make_partition_fn(RematConfig(enabled=False)) is min_cut_rematerialization_partition
    assert dcr.make_partition_fn(RematConfig()) is not min_cut_rematerialization_partition


def test_backward_state_is_free_to_save():
    """Compiled autograd's BackwardState reaches the backward by reference: like torch, cost
    it 0 rather than 'cannot be saved' (which made a graph that needs it unpartitionable)."""
    import torch.fx as fx
    from torch.fx.experimental._backward_state import BackwardState

    from deepcompile_remat import _C
    from deepcompile_remat.partition import fx_export

    g = fx.Graph()
    x, state, tangent = g.placeholder("primals_1"), g.placeholder("primals_2"), g.placeholder(
        "tangents_1")
    y = g.call_function(torch.ops.aten.sin.default, (x,))
    g.output([y, tangent])
    for node, val in ((x, torch.empty(8)), (state, BackwardState()), (tangent, torch.empty(8)),
                      (y, torch.empty(8))):
        node.meta["val"] = val
    exported = fx_export.export_joint_graph(fx.GraphModule({}, g), num_fwd_outputs=1)
    flags = [int(f) for f in exported.flags]  # bits of the C++ enum, exported by _C
    assert not flags[1] & _C.NodeFlag.NON_TENSOR and exported.bytes[1] == 0
    assert flags[1] & _C.NodeFlag.PRIMAL
