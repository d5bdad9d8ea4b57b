"""Activation offload (RematConfig.offload_activations, partition/offload.py): saved activations
copied to the host in the forward and back before their first use in the backward. One
process, no ZeRO-3: offload is the partition library's. On a CPU the host is the same memory,
so these tests prove the data path (gradients equal the run without offload, the graphs hand
the backward host copies) and what the simulator and the report say a GPU would hold.

Caches off: a warm AOTAutograd or inductor cache would skip the partitioner and its report.
"""
import pytest
import torch
import torch.nn as nn

import deepcompile_remat as dcr
from deepcompile_remat import fx_arrays
from deepcompile_remat.partition import offload

ROWS, WIDTH = 1024, 512  # each matmul output: 2 MiB in fp32, above offload.MIN_BYTES


class Mlp(nn.Module):
    """Deep enough that the backward's peak is at its start, where every saved activation
    would be held at once."""

    def __init__(self, depth=6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            h = layer(x)
            x = torch.tanh(h) * h
        return x.pow(2).mean()


def _grads(kind, **remat):
    torch._dynamo.reset()
    dcr.clear_reports()
    torch.manual_seed(0)
    model = Mlp()
    x = torch.randn(ROWS, WIDTH)
    run = model if kind is None else torch.compile(
        model, backend=dcr.backend(kind, dcr.RematConfig(**remat)))
    loss = run(x)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(autouse=True)
def _no_compile_caches(monkeypatch):
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    monkeypatch.setattr(functorch_config, "enable_autograd_cache", False)


@pytest.mark.parametrize("kind", ["eager", "inductor"])
def test_offloaded_activations_give_the_same_gradients(kind):
    """Silent bugs guarded: a backward that reads the host copy before it is made or a stale
    one, a value handed over twice, a user output moved off the accelerator. A link priced
    near free (1 flop a byte) so every saved activation moves."""
    ref_loss, ref = _grads(None)
    loss, grads = _grads(kind, offload_activations=True, host_link_flops_per_byte=1.0)
    (rep,) = dcr.reports()
    moved = rep.offload
    assert moved is not None and len(moved.values) >= 2, rep.summary()
    assert moved.bytes_each_way == sum(b for _, b in moved.values) >= 2 * 2 ** 21
    assert all(b >= offload.MIN_BYTES for _, b in moved.values)
    assert set(name for name, _ in moved.values) <= {v.name for v in rep.saved}
    # The accelerator holds less from the forward to the backward, by the simulator's count.
    assert moved.simulated_peak_after < moved.simulated_peak_before, rep.summary()
    assert "offloaded" in rep.summary() and "MiB each way" in rep.summary()
    torch.testing.assert_close(loss, ref_loss)
    for name, g in ref.items():
        torch.testing.assert_close(grads[name], g, msg=lambda m: f"{name}: {m}")


def test_a_slow_link_offloads_nothing_and_off_is_the_default():
    """The copies must fit under the step's compute: at a link priced above what the step
    computes, no value moves; without the key no offload runs at all."""
    _grads("eager", offload_activations=True, host_link_flops_per_byte=1e9)
    (rep,) = dcr.reports()
    assert rep.offload is not None and rep.offload.values == () and rep.offload.candidates >= 2
    assert "device_put" not in " ".join(rep.forward_ops)
    _grads("eager")
    (rep,) = dcr.reports()
    assert rep.offload is None and "offloaded" not in rep.summary()


def test_the_graphs_hand_the_backward_host_copies():
    """What the rewrite does to the graphs: each chosen value's host copy is made right after
    it, the forward returns the copy, and the backward copies it back before its first use;
    the simulator gives host values no accelerator bytes."""
    captured = []
    real_apply = offload.apply

    def spy(fw, bw, chosen, **kw):
        figures = real_apply(fw, bw, chosen, **kw)
        captured.append((fw, bw, figures))
        return figures

    offload.apply = spy
    try:
        _grads("eager", offload_activations=True, host_link_flops_per_byte=1.0)
    finally:
        offload.apply = real_apply
    (fw, bw, figures), = captured
    names = {name for name, _ in figures.values}
    out = fw.graph.find_nodes(op="output")[0]
    handed = [n for n in out.all_input_nodes if n.meta.get(fx_arrays.ON_HOST)]
    assert {n.args[0].name for n in handed} == names
    for n in handed:
        assert n.target is torch.ops.prims.device_put.default and n.prev is n.args[0]
    for p in bw.graph.find_nodes(op="placeholder"):
        if p.name in names:
            (back,) = p.users
            assert back.target is torch.ops.prims.device_put.default
            assert p.meta.get(fx_arrays.ON_HOST) and not back.meta.get(fx_arrays.ON_HOST)
    memory = fx_arrays.memory_graph(bw)
    arrays = fx_arrays.graph_arrays(bw)
    for p in bw.graph.find_nodes(op="placeholder"):
        if p.name in names:
            assert memory.bytes[arrays.ids[p]] == 0
