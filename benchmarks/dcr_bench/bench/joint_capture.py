"""The joint graphs the benchmarks partition: the models (the built-in GPT, a transformers
Llama, and bench-partition's end-to-end graphs, SPEED_GRAPHS) and their joint
forward/backward graphs, captured once as AOTAutograd hands them to a partitioner
(JointCapture), so every partitioner can be given its own deep copy of the same graph.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass


@dataclass
class JointCapture:
    """One joint graph as AOTAutograd handed it to the partitioner, with the arguments both
    partitioners are called with."""
    joint: object  # fx.GraphModule
    num_fwd_outputs: int
    static_lifetime_input_indices: list


def capture_joint(fn, *inputs, autocast: bool = False) -> JointCapture:
    """The first joint forward/backward graph torch.compile's AOTAutograd builds for
    fn(*inputs) (under CPU bf16 autocast when `autocast`)."""
    import torch
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    captured = []

    def keep(joint, joint_inputs, *, num_fwd_outputs, static_lifetime_input_indices=None, **kw):
        with unset_fake_temporarily():  # module constants are real tensors: copy them as such
            captured.append(JointCapture(copy.deepcopy(joint), num_fwd_outputs,
                                         list(static_lifetime_input_indices or ())))
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                 static_lifetime_input_indices=static_lifetime_input_indices,
                                 **kw)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=lambda gm, _: gm, partition_fn=keep)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    torch._dynamo.reset()
    return captured[0]


def gpt_model(layers: int = 24, d_model: int = 256, seq: int = 64) -> tuple:
    """The depth sweep's GPT encoder (harness.models.GPT), seeded: (module, inputs)."""
    import torch

    from dcr_bench.harness.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab=256, d=d_model, layers=layers, heads=4, max_t=seq)
    return model, (torch.randint(0, 256, (2, seq)),)


def llama_model(layers: int = 16, hidden: int = 64, seq: int = 64, *, vocab: int = 128,
                heads: int = 4, batch: int = 2) -> tuple:
    """A transformers Llama with random weights (harness.models.build_hf; max(heads // 2, 1)
    key/value heads, no dropout), seeded: (a function returning its logits, inputs: `batch`
    sequences of `seq` token ids)."""
    import torch

    from dcr_bench.harness.models import build_hf

    torch.manual_seed(0)
    model = build_hf("llama", vocab=vocab, hidden=hidden, layers=layers, heads=heads,
                     kv_heads=max(heads // 2, 1), seq=seq, dropout=0.0)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    return (lambda x: model(input_ids=x).logits), (ids,)


# The end-to-end graphs: name -> (builder, its sizes at full scale, at --tiny scale).
SPEED_GRAPHS = {
    "gpt24": (gpt_model, dict(layers=24, d_model=256, seq=64), dict(layers=2, d_model=64, seq=16)),
    "llama16": (llama_model, dict(layers=16, hidden=64, seq=64), dict(layers=2, hidden=32, seq=16)),
}


def build_speed_model(name: str, tiny: bool = False) -> tuple:
    """(fn, inputs) of one of SPEED_GRAPHS, at its full sizes or its tiny ones."""
    builder, full, small = SPEED_GRAPHS[name]
    return builder(**(small if tiny else full))


def capture_joint_graph(layers: int, *, d_model: int, seq: int, autocast: bool) -> JointCapture:
    """The joint forward/backward graph of a `layers`-deep GPT, captured once through
    torch.compile with AOTAutograd (under CPU bf16 autocast when `autocast`)."""
    model, inputs = gpt_model(layers, d_model, seq)
    return capture_joint(model, *inputs, autocast=autocast)
