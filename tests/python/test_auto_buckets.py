"""bucket_bytes "auto", the default (zero3/unit_buckets.py, issue 41 item 1): each compiled graph
gathers a layer in one collective and reduce-scatters its gradients in one, as FSDP2's
per-layer units do, read from the graph, and the report says what was chosen.

Before: the default was a fixed 64 KB, which left every larger weight in a collective of its
own (134 collective calls a step at the profile's H100 shape; 92 at llama 4x512 seq 1024
against FSDP2's 14)."""
import copy

import pytest
import torch
import torch.distributed as dist

import deepcompile_remat as dcr
from deepcompile_remat import zero3
from deepcompile_remat.zero3.unit_buckets import layer_of
from dist_utils import assert_trains_like_one_process, run_ranks

transformers = pytest.importorskip("transformers")
LAYERS = 3


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=LAYERS, num_attention_heads=4)
    return transformers.AutoModelForCausalLM.from_config(config)


def _train(model, batches, run):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for ids in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _collectives(report, graph):
    """(gathers, reduce-scatters) the report lists for graph "fw" or "bw"."""
    ops = [c for c in report.collectives if c.startswith(graph + ":")]
    return (sum("allgather" in op for op in ops), sum("reduce_scatter" in op for op in ops))


def _auto_trains(rank, world, bucket_bytes):
    model = _llama()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (2 * world, 16), generator=gen) for _ in range(2)]
    local = [b.chunk(world)[rank] for b in batches]
    zero3.shard(model)
    config = dcr.RematConfig(bucket_bytes=bucket_bytes)
    run = torch.compile(model, backend=dcr.backend("inductor", config))
    losses = _train(model, local, run)
    assert_trains_like_one_process(model, reference, losses, _train(reference, batches,
                                                                    reference), True, world)
    [report] = dcr.reports()
    fw, bw = _collectives(report, "fw"), _collectives(report, "bw")
    if bucket_bytes == "auto":
        # One per layer and direction, and one for the model around the layers (embedding,
        # final norm, head): FSDP2's units, layers + root.
        assert fw == (LAYERS + 1, 0), report.collectives
        assert bw == (LAYERS + 1, LAYERS + 1), report.collectives
        assert f"the largest of {LAYERS} layers, model.layers." in report.summary()
        [fig_fw, fig_bw] = report.schedule
        assert 0 < fig_fw.bucket_bytes < fig_bw.grad_bucket_bytes  # bf16 gathers, fp32 grads
    else:  # a number the user set is taken as it is: more, smaller collectives
        assert fw[0] > LAYERS + 1 and bw[1] > LAYERS + 1, report.collectives
        assert "buckets from the graph" not in report.summary()
        assert all(f.bucket_bytes == bucket_bytes for f in report.schedule)


@pytest.mark.parametrize("bucket_bytes", ["auto", 1 << 14])
def test_auto_buckets_are_one_collective_per_layer_and_train_like_one_process(bucket_bytes):
    run_ranks(_auto_trains, 2, bucket_bytes)


def test_a_layer_is_the_path_up_to_its_first_index():
    assert layer_of("model.layers.3.self_attn.q_proj") == "model.layers.3"
    assert layer_of("transformer.h[11].mlp") == "transformer.h[11]"
    assert layer_of("encoder.block.5.layer.0") == "encoder.block.5"
    assert layer_of("lm_head") == "" and layer_of("") == ""


def test_bucket_bytes_takes_auto_or_an_integer():
    assert dcr.RematConfig().bucket_bytes == "auto"
    assert dcr.RematConfig.from_dict({"bucket_bytes": 1024}).bucket_bytes == 1024
    for bad in ("Auto", -1, 1.5, True, None):
        with pytest.raises(ValueError, match="bucket_bytes"):
            dcr.RematConfig(bucket_bytes=bad)
