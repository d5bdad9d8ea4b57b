"""Training idioms on sharded parameters: writes (re-init, .data, surgery, tie_weights),
gradient clipping over the global norm, the full shape of a shard, and the process group as
the data-parallel group. 2 CPU ranks over gloo."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import deepcompile_remat as dcr
from deepcompile_remat import zero3
from dcr_bench.harness.models import GPT, MLP
from dist_utils import full_grads, run_ranks


# --- writes ----------------------------------------------------------------------------------

def _writes_outside_raise(rank, world):
    model = zero3.shard(MLP(d=8))
    before = model.state_dict()
    writes = {
        "nn.init": lambda: nn.init.zeros_(model.fc1.weight),
        "fill_": lambda: model.fc1.weight.fill_(1.0),
        ".data": lambda: model.fc1.weight.data.normal_(),
        "setitem": lambda: model.fc1.weight.__setitem__(0, 1.0),
        "view": lambda: model.fc1.weight.view(-1)[:3].zero_(),
        "+=": lambda: model.fc1.bias.__iadd__(1.0),
        "out=": lambda: torch.add(model.fc1.bias, 1.0, out=model.fc1.bias),
        "requires_grad": lambda: setattr(model.fc1.weight, "requires_grad", False),
    }
    for what, write in writes.items():
        with torch.no_grad(), pytest.raises(RuntimeError, match="writes to Linear.(weight|bias), a "
                                            "sharded parameter.*gathered_parameters"):
            write()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # reads still work, and give plain tensors
    y = model.fc1.weight @ torch.randn(8)
    assert type(y) is torch.Tensor


def test_writes_to_a_gathered_copy_raise():
    """nn.init.zeros_(m.weight) after shard() changed a gathered copy: the write was lost and
    training went on with the old weights, silently."""
    run_ranks(_writes_outside_raise, 2)


def _reinit_and_surgery(rank, world):
    torch.manual_seed(0)
    model = zero3.shard(MLP(d=8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shard_before = model.fc1._parameters["weight"]
    # Re-init: rank 0's values win, whatever the other ranks wrote.
    with zero3.gathered_parameters(model, modifier_rank=0):
        assert isinstance(model.fc1.weight, nn.Parameter) and model.fc1.weight.shape == (32, 8)
        nn.init.constant_(model.fc1.weight, 0.5 if rank == 0 else -1.0)
        model.fc1.bias.data.zero_()
    assert model.fc1._parameters["weight"] is shard_before  # the optimizer's reference holds
    assert any(p is shard_before for g in opt.param_groups for p in g["params"])
    full = model.state_dict()
    assert torch.all(full["fc1.weight"] == 0.5) and torch.all(full["fc1.bias"] == 0)
    # Surgery: a new, wider output layer, and a tie between two layers of the same shape.
    torch.manual_seed(1)
    with zero3.gathered_parameters(model, modifier_rank=0):
        model.fc2 = nn.Linear(32, 12)
        model.extra = nn.Linear(12, 12, bias=False)
        model.tied = nn.Linear(12, 12, bias=False)
        model.tied.weight = model.extra.weight  # tie_weights inside the block
        reference = copy.deepcopy(model)  # unsharded, inside the block
    assert zero3.is_sharded(model.fc2) and model.fc2._parameters["weight"].ds_shape == (12, 32)
    assert model.tied._parameters["weight"] is model.extra._parameters["weight"]  # one shard
    x = torch.randn(4, 8)
    torch.testing.assert_close(model.fc2(torch.relu(model.fc1(x))),
                               reference.fc2(torch.relu(reference.fc1(x))))
    # Same change on every rank without modifier_rank: checked, and accepted.
    with zero3.gathered_parameters(model):
        model.fc1.weight.data.mul_(2)
    assert torch.all(model.state_dict()["fc1.weight"] == 1.0)
    # Different changes without modifier_rank: an error that names the parameter.
    with pytest.raises(ValueError, match="parameter 'fc1.bias' differs between this rank"):
        with zero3.gathered_parameters(model):
            model.fc1.bias.data.fill_(float(rank))


def test_gathered_parameters_reinit_and_surgery():
    """Re-init after wrapping and weight surgery must reach the shards (and the optimizer's
    parameter objects), and ranks must not silently end up with different weights."""
    run_ranks(_reinit_and_surgery, 2)


class Untied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(13, 7)
        self.head = nn.Linear(7, 13, bias=False)

    def forward(self, idx):
        return self.head(torch.tanh(self.emb(idx)))


def _tie_after_shard(rank, world, kind):
    torch.manual_seed(0)
    model = Untied()
    reference = copy.deepcopy(model)
    reference.head.weight = reference.emb.weight  # tied before: the unsharded truth
    zero3.shard(model)
    model.head.weight = model.emb.weight  # HF-style tie_weights, after wrapping
    assert sum(1 for _ in model.parameters()) == 1
    run = model if kind == "uncompiled" else torch.compile(model, backend=dcr.backend(kind))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(3):
        idx = torch.randint(0, 13, (4, 5))
        run(idx[rank * 2:(rank + 1) * 2]).logsumexp(-1).mean().backward()
        reference(idx).logsumexp(-1).mean().backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    torch.testing.assert_close(model.state_dict()["emb.weight"], reference.emb.weight.detach())
    torch.testing.assert_close(model.state_dict()["head.weight"], reference.emb.weight.detach())


@pytest.mark.parametrize("kind", ["uncompiled", "eager"])
def test_tie_weights_after_shard(kind):
    """HF's tie_weights assigns one module's weight to another after wrapping: it used to be
    a TypeError (a gathered copy is no Parameter); now it ties the two to one shard."""
    run_ranks(_tie_after_shard, 2, kind)


# --- clipping, shapes, groups ------------------------------------------------------------------

def _clip(rank, world, norm_type):
    torch.manual_seed(0)
    model = GPT(layers=1)
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 64, (4, 16))
    zero3.shard(model)
    model(idx[rank * 2:(rank + 1) * 2]).logsumexp(-1).mean().backward()
    reference(idx).logsumexp(-1).mean().backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3, norm_type)
    norm = zero3.clip_grad_norm_(model, 1e-3, norm_type)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)
    assert ref_norm > 1e-3  # the clip is active
    grads = full_grads(model)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["l2", "inf"])
def test_clip_grad_norm_is_the_global_norm(norm_type):
    """torch.nn.utils.clip_grad_norm_ on shards clips each rank's slice by its own norm;
    ours must equal clipping the unsharded model."""
    run_ranks(_clip, 2, norm_type)


def _full_shapes(rank, world):
    model = GPT(layers=1)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    zero3.shard(model)
    for n, p in model.named_parameters():
        assert p.dim() == 1 and p.ds_shape == shapes[n] and p.ds_numel == shapes[n].numel()
    decay = {n for n, p in model.named_parameters() if len(p.ds_shape) >= 2}
    assert decay == {n for n, s in shapes.items() if len(s) >= 2}


def test_shards_expose_their_full_shape():
    """Weight-decay grouping by dim() >= 2 saw only 1-D shards and decayed nothing."""
    run_ranks(_full_shapes, 2)


def _subgroup(rank, world):
    torch.manual_seed(0)
    mine = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    with pytest.raises(ValueError, match="has 1 of the 2 ranks.*group_is_data_parallel=True"):
        zero3.shard(MLP(d=8), group=mine)
    # Declared the whole data-parallel group: each rank trains alone on its own data.
    torch.manual_seed(rank)
    model = MLP(d=8)
    reference = copy.deepcopy(model)
    zero3.shard(model, group=mine, group_is_data_parallel=True)
    x = torch.randn(4, 8)
    model(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    grads = full_grads(model)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_subgroup_must_be_declared_data_parallel():
    """shard(group=subgroup) averaged gradients over the subgroup only: right for a
    tensor-parallel layout, silently wrong for data parallelism over the world."""
    run_ranks(_subgroup, 2)
