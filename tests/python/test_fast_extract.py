"""Our module extraction (partition/extract_fast.py), CSE (cse.py) and DCE (dce.py) against
torch's: on real joint graphs (the model zoo, a GPT under autocast and with dropout, HF
Llama and GPT-2, dynamic shapes, activation checkpointing, effect tokens) the forward and
backward modules are the same graphs, node for node, as torch's path builds from the same
cut, and training through either gives bitwise-equal outputs and gradients."""
import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

import deepcompile_remat as dcr
from dcr_bench.harness.models import GPT, Block, zoo
from deepcompile_remat.partition import cse, dce, extract, extract_fast


def _graph_lines(gm: torch.fx.GraphModule) -> list[str]:
    return [n.format_node() for n in gm.graph.nodes]


def _signature(gm: torch.fx.GraphModule) -> tuple:
    out = gm.graph.find_nodes(op="output")[0]
    return ([n.name for n in gm.graph.find_nodes(op="placeholder")],
            [getattr(x, "name", x) for x in out.args[0]], out.meta.get("desc"))


class _ExtractionRecorder:
    """Wraps extract.extract_fwd_bwd_modules: runs torch's path on copies of the same saved
    lists first, then the real call, and compares the two on the spot (later passes rewrite
    the modules in place)."""

    def __init__(self):
        self.paths: list[str] = []
        self.mismatches: list[str] = []
        self._real = extract.extract_fwd_bwd_modules

    def __call__(self, joint, saved_values, saved_sym, saved_opaque, **kwargs):
        lists = (list(saved_values), list(saved_sym), list(saved_opaque))
        theirs = extract.torch_extract_fwd_bwd_modules(joint, *lists, **kwargs)
        times: dict = {}
        ours = self._real(joint, saved_values, saved_sym, saved_opaque, times=times, **kwargs)
        self.paths.append(times["path"])
        if (list(saved_values), list(saved_sym)) != lists[:2]:
            self.mismatches.append(f"saved lists: {saved_values, saved_sym} vs {lists[:2]}")
        for side, a, b in (("forward", ours[0], theirs[0]), ("backward", ours[1], theirs[1])):
            if _signature(a) != _signature(b):
                self.mismatches.append(f"{side} signature: {_signature(a)} vs {_signature(b)}")
            if _graph_lines(a) != _graph_lines(b) or a.code != b.code:
                self.mismatches.append(f"{side} graph:\n{a.code}\nvs torch's\n{b.code}")
            marks = [[n.meta.get("autograd_backward") for n in m.graph.nodes] for m in (a, b)]
            if marks[0] != marks[1]:
                self.mismatches.append(f"{side} autograd_backward marks differ")
        return ours


def _train(fn, inputs, params, *, dynamic=False, autocast=False, force_torch=False):
    """Compiles fn with our partitioner (eager backend), runs forward and backward; returns
    the output, the input and parameter gradients, and the recorder."""
    recorder = _ExtractionRecorder()
    mp = pytest.MonkeyPatch()
    mp.setattr(extract, "extract_fwd_bwd_modules", recorder)
    if force_torch:
        mp.setattr(extract_fast, "unsupported_reason", lambda *a: "forced by the test")
    try:
        torch._dynamo.reset()
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = torch.compile(fn, backend=dcr.backend("eager"), dynamic=dynamic,
                                fullgraph=True)(*inputs)
        out.float().pow(2).mean().backward()
    finally:
        mp.undo()
    leaves = [x for x in [*inputs, *params] if isinstance(x, torch.Tensor) and x.requires_grad]
    grads = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    return out.detach(), grads, recorder


# --- the graphs -----------------------------------------------------------------------------

_CALLS = [0]


@torch.library.custom_op("dcr_fast_extract_test::tally", mutates_args=())
def _tally(x: torch.Tensor) -> torch.Tensor:
    _CALLS[0] += 1
    return x * 2


_tally.register_fake(lambda x: torch.empty_like(x))
_tally.register_autograd(lambda ctx, g: g * 2)


def _zoo_case(name):
    model_fn, input_fn, _ = zoo()[name]
    model = model_fn()
    return model, [input_fn()], list(model.parameters())


def _hf_case(preset, **sizes):
    from dcr_bench.harness import models as hf_models

    model = hf_models.build_hf(preset, layers=2, hidden=64, seq=16, **sizes)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    return (lambda x: model(input_ids=x).logits), [ids], list(model.parameters())


def _checkpointed_block(dropout):
    block = Block(dropout=dropout)
    x = torch.randn(2, 8, 32, requires_grad=True)
    return (lambda x: checkpoint(block, x, use_reentrant=False)), [x], list(block.parameters())


def _checkpointed_stack():
    """Two checkpointed blocks: each builds the same causal mask, in its own region."""
    blocks = nn.ModuleList([Block(), Block()])
    x = torch.randn(2, 8, 32, requires_grad=True)

    def fn(x):
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x

    return fn, [x], list(blocks.parameters())


def _selective_checkpoint():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    fc1, fc2 = nn.Linear(32, 32), nn.Linear(32, 32)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default \
            else CheckpointPolicy.PREFER_RECOMPUTE

    ctx = functools.partial(create_selective_checkpoint_contexts, policy)
    x = torch.randn(4, 32, requires_grad=True)
    fn = lambda x: checkpoint(lambda x: fc2(fc1(x).relu()).relu(), x,  # noqa: E731
                              use_reentrant=False, context_fn=ctx)
    return fn, [x], [*fc1.parameters(), *fc2.parameters()]


class _GradIsSaved(torch.autograd.Function):
    """A backward that returns a saved forward value as it is: the backward's output is a
    node of the forward."""

    @staticmethod
    def forward(ctx, x):
        y = x.sin().exp()
        ctx.save_for_backward(y)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return y


def _grad_is_saved():
    x = torch.randn(64, requires_grad=True)
    return (lambda x: _GradIsSaved.apply(x).cos()), [x], []


def _effectful():
    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    return (lambda x: _tally(lin(x).sin()).cos() * x), [x], list(lin.parameters())


# name -> (build() -> (fn, inputs, params), compile kwargs, expected path prefix)
CASES = {
    **{f"zoo-{name}": (functools.partial(_zoo_case, name), {}, "ours")
       for name in ("mlp", "layernorm", "attention", "gpt", "conv_bn")},
    "gpt-4-layers-autocast": (
        lambda: (lambda m: (m, [torch.randint(0, 64, (2, 16))], list(m.parameters())))(
            GPT(layers=4)), {"autocast": True}, "ours"),
    "gpt-dropout": (
        lambda: (lambda m: (m, [torch.randint(0, 64, (2, 16))], list(m.parameters())))(
            GPT(layers=2, dropout=0.1)), {}, "ours"),
    "hf-llama": (functools.partial(_hf_case, "llama"), {}, "ours"),
    "hf-gpt2-dropout": (functools.partial(_hf_case, "gpt2"), {}, "ours"),
    "dynamic-mlp": (
        lambda: (lambda m: (m, [torch.randn(3, 5, 32)], list(m.parameters())))(
            zoo()["mlp"][0]()), {"dynamic": True}, "ours"),
    "dynamic-gpt": (
        lambda: (lambda m: (m, [torch.randint(0, 64, (2, 12))], list(m.parameters())))(
            GPT(layers=2)), {"dynamic": True}, "ours"),
    "checkpoint": (functools.partial(_checkpointed_block, 0.0), {}, "ours"),
    "checkpoint-2-regions": (_checkpointed_stack, {}, "ours"),
    "selective-checkpoint": (_selective_checkpoint, {}, "ours"),
    # a seeded random op recomputed in the backward: its RNG state must be replayed, which
    # only torch's path does; ours must step aside, and say why
    "checkpoint-dropout": (functools.partial(_checkpointed_block, 0.1), {}, "torch: random ops"),
    "effect-tokens": (_effectful, {}, "ours"),
    "gradient-is-a-saved-value": (_grad_is_saved, {}, "ours"),
}


@pytest.fixture
def effectful_tally():
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

    handle = _register_effectful_op(torch.ops.dcr_fast_extract_test.tally.default,
                                    _EffectType.ORDERED)
    yield
    if handle is not None:
        handle.destroy()


# On a torch whose extraction ours does not reproduce (2.11), every graph must take torch's path,
# saying why; the numbers are then torch's own.
OTHER_LAYOUT = "torch: this torch lays out saved values differently"


@pytest.mark.parametrize("case", list(CASES))
def test_same_modules_and_gradients_as_torchs_extraction(case, effectful_tally):
    build, kwargs, expected_path = CASES[case]
    if not extract_fast.torch_layout_supported():
        expected_path = OTHER_LAYOUT
    torch.manual_seed(0)
    fn, inputs, params = build()
    out, grads, rec = _train(fn, inputs, params, **kwargs)
    assert rec.paths and all(p.startswith(expected_path) for p in rec.paths), rec.paths
    assert not rec.mismatches, "\n".join(rec.mismatches)
    # Training through torch's path only: bitwise the same numbers.
    out_t, grads_t, rec_t = _train(fn, inputs, params, force_torch=True, **kwargs)
    assert all(p == "torch: forced by the test" for p in rec_t.paths), rec_t.paths
    assert torch.equal(out, out_t)
    assert len(grads) == len(grads_t) and all(torch.equal(a, b) for a, b in zip(grads, grads_t))


def test_effectful_op_runs_once(effectful_tally):
    fn, inputs, params = _effectful()
    _CALLS[0] = 0
    _, _, rec = _train(fn, inputs, params)
    path = "ours" if extract_fast.torch_layout_supported() else OTHER_LAYOUT
    assert rec.paths == [path] and _CALLS[0] == 1


# --- CSE and DCE against torch's ------------------------------------------------------------

def _joint_graphs():
    """Joint graphs as AOTAutograd hands them over (zoo GPT, HF Llama, two checkpointed
    blocks)."""
    from dcr_bench.bench.joint_capture import capture_joint

    graphs = []
    for build in (functools.partial(_zoo_case, "gpt"), functools.partial(_hf_case, "llama"),
                  _checkpointed_stack):
        fn, inputs, _ = build()
        graphs.append(capture_joint(fn, *inputs).joint)
    return graphs


def test_cse_and_dce_match_torchs():
    """Same DCE everywhere; the same CSE where no checkpoint tags tell nodes apart (the
    checkpointed graph is the rule we add: see test_cse_keeps_checkpoint_regions_apart)."""
    from torch._functorch.compile_utils import fx_graph_cse

    merged = 0
    for joint in _joint_graphs()[:2]:
        ours, theirs = copy.deepcopy(joint), copy.deepcopy(joint)
        dce.eliminate_dead_code(ours)
        theirs.graph.eliminate_dead_code()
        assert _graph_lines(ours) == _graph_lines(theirs)
        merged += cse.eliminate_common_subexpressions(ours.graph)
        theirs.graph = fx_graph_cse(theirs.graph)
        assert _graph_lines(ours) == _graph_lines(theirs)
        assert [n.meta["mutation_region_id"] for n in ours.graph.nodes] == \
            [n.meta["mutation_region_id"] for n in theirs.graph.nodes]
    assert merged > 0


def test_cse_keeps_checkpoint_regions_apart():
    """Duplicates inside one region merge; across regions (or tagged against untagged) they
    stay apart, so no region reads a value another region computed."""
    joint = _joint_graphs()[2]
    dce.eliminate_dead_code(joint)
    cse.eliminate_common_subexpressions(joint.graph)
    seen = {}
    for n in joint.graph.nodes:
        if n.op != "call_function" or cse._never_merged(n.target):
            continue
        key = (n.target, cse._key(n.args), cse._key(n.kwargs), n.meta.get("recompute"),
               n.meta.get("ac_graph_id"), n.meta["mutation_region_id"])
        assert key not in seen, f"{n.name} duplicates {seen[key].name}"  # nothing left to merge
        seen[key] = n
    # each block builds its causal mask (ones -> tril -> not) in its own region, and keeps it
    masks = [n.meta.get("ac_graph_id") for n in joint.graph.nodes
             if n.target is torch.ops.aten.tril.default]
    assert len(masks) == 2 and len(set(masks)) == 2 and None not in masks, masks
    theirs = copy.deepcopy(joint)  # torch's merges them: one region reads the other's mask
    from torch._functorch.compile_utils import fx_graph_cse

    assert sum(n.target is torch.ops.aten.tril.default
               for n in fx_graph_cse(theirs.graph).nodes) == 1


def _traced(fn, *args) -> torch.fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn)(*args)


def test_cse_merges_pure_duplicates_only():
    def f(x, y):
        a, b = x.sin(), x.sin()  # merged
        r1, r2 = torch.rand_like(x), torch.rand_like(x)  # two draws: never merged
        c = a + b + r1 + r2
        y.add_(1)  # a mutation: x.cos() after it is its own region
        d, e = x.cos(), x.cos()  # merged with each other
        return c + d + e + y

    gm = _traced(f, torch.randn(4), torch.randn(4))
    before = [n.target for n in gm.graph.nodes]
    assert cse.eliminate_common_subexpressions(gm.graph) == 2
    after = [n.target for n in gm.graph.nodes]
    aten = torch.ops.aten
    assert before.count(aten.sin.default) == 2 and after.count(aten.sin.default) == 1
    assert after.count(aten.rand_like.default) == 2
    assert after.count(aten.cos.default) == 1


def test_cse_keeps_distinct_outputs_distinct():
    gm = _traced(lambda x: (x.view(-1), x.view(-1)), torch.randn(2, 2))
    assert cse.eliminate_common_subexpressions(gm.graph) == 0


def test_cse_does_not_merge_across_a_mutation():
    def f(x):
        a = x.clone()
        s1 = a.sum()
        a.mul_(2)
        s2 = a.sum()  # reads the mutated a: a different value
        return s1 + s2

    gm = _traced(f, torch.randn(4))
    cse.eliminate_common_subexpressions(gm.graph)
    gm.recompile()
    x = torch.randn(4)
    torch.testing.assert_close(gm(x), x.sum() * 3)
