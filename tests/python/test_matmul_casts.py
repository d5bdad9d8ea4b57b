"""partition/matmul_casts.py: the casts that only feed matmuls, on a graph of the shape an
autocast linear layer's backward has (an fp32 gradient that needs per-row values, cast to bf16,
viewed to 2-D, multiplied), compiled by inductor with its caches off (the kernel count is what
is checked)."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from deepcompile_remat.partition.matmul_casts import shape_matmul_casts

S, H = 64, 32
bf16 = torch.bfloat16


def layer_backward_like(x, grad, w, v):
    # per-row values: inductor keeps this producer's loops [1, S, H]
    y = grad + x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))
    from_computed = torch.mm(y.to(bf16).view(S, H), w)        # the mid-layer cast
    from_input = torch.mm(grad.to(bf16).view(S, H).t(), v)     # the incoming gradient's
    pointwise = y.to(bf16) * 2                                 # inlined already: left alone
    return from_computed, from_input, y, pointwise


def inputs():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(1, S, H, generator=gen), torch.randn(1, S, H, generator=gen),
            torch.randn(H, H, generator=gen).to(bf16), torch.randn(S, H, generator=gen).to(bf16))


def traced():
    """As AOTAutograd hands inductor a graph: decomposed by inductor's table (a cast is then
    prims.convert_element_type)."""
    from torch._inductor.decomposition import select_decomp_table

    gm = make_fx(layer_backward_like, decomposition_table=select_decomp_table())(*inputs())
    gm.graph.eliminate_dead_code()  # the bf16 mm decomposition's unused upcasts
    gm.recompile()
    return gm


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_only_the_casts_that_feed_matmuls_are_rewritten():
    gm = traced()
    casts = torch.ops.prims.convert_element_type.default
    assert targets(gm).count(casts) == 3
    assert shape_matmul_casts(gm) == 2
    after = targets(gm)
    assert after.count(torch.ops.dcr_opaque.cast_to.default) == 1
    assert after.count(torch.ops.prims.inductor_force_stride_order.default) == 1
    assert after.count(casts) == 2  # the mid-layer cast (now realized first) and the pointwise's
    (opaque,) = [n for n in gm.graph.nodes if n.target is torch.ops.dcr_opaque.cast_to.default]
    assert opaque.args[0].op == "placeholder"
    assert shape_matmul_casts(gm) == 0, "a second pass must find nothing left to do"


def compiled(gm, args):
    from torch._inductor.compile_fx import compile_fx_inner

    with torch._inductor.config.patch(fx_graph_cache=False, fx_graph_remote_cache=False):
        fn = compile_fx_inner(gm, list(args))
    return fn(list(args))


@pytest.mark.parametrize("rewrite", [False, True], ids=["as-traced", "rewritten"])
def test_compiled_values_match_eager(rewrite):
    gm = traced()
    if rewrite:
        shape_matmul_casts(gm)
    got = compiled(gm, inputs())
    want = layer_backward_like(*inputs())
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.stride() == w.stride()
        torch.testing.assert_close(g, w)


def compiled_llama(rewrite: bool, monkeypatch):
    """(loss, gradients, the distinct C++ kernel sources inductor compiled) of one step of a
    1-layer transformers llama under bf16 autocast, through dcr.backend("inductor")."""
    from torch._inductor.async_compile import AsyncCompile

    import deepcompile_remat as dcr
    from dcr_bench.harness import models
    from deepcompile_remat.partition import matmul_casts

    if not rewrite:
        monkeypatch.setattr(matmul_casts, "shape_matmul_casts", lambda gm: 0)
    sources = set()
    compile_cpp = AsyncCompile.cpp_pybinding

    def recorded(self, argtypes, source_code):
        sources.add(source_code)
        return compile_cpp(self, argtypes, source_code)

    monkeypatch.setattr(AsyncCompile, "cpp_pybinding", recorded)
    torch.manual_seed(0)
    model = models.build_hf("llama", layers=1, hidden=64)
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=dcr.backend("inductor"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, sources


def test_a_transformers_llama_compiles_fewer_kernels_to_the_same_gradients(monkeypatch):
    pytest.importorskip("transformers")
    loss, grads, shaped = compiled_llama(True, monkeypatch)
    monkeypatch.undo()
    ref_loss, ref_grads, plain = compiled_llama(False, monkeypatch)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name, g in grads.items():  # the same arithmetic, so the same bits
        torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=0, msg=name)
    # as traced: the residual gradient's cast is a kernel of its own (the incoming gradient's
    # cast compiles to the same source); shaped: it joins its producer's kernel, and the
    # incoming gradient's runs as aten's cast
    assert len(shaped) == len(plain) - 1, (len(shaped), len(plain))
