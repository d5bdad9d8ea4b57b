"""Hybrid sharding (zero3.shard with a replicate group or a 2-D DeviceMesh, FSDP2's HSDP) on 4
gloo ranks as 2 replicas x 2 shards: training matches one unsharded process, the backward
averages each reduce-scattered gradient over the replicas (a node of its own in the compiled
graph), checkpoints save and load, and bad groups are refused."""
import copy

import pytest
import torch
import torch.distributed as dist

import deepcompile_remat as dcr
from deepcompile_remat import zero3
from dcr_bench.harness.models import GPT
from dist_utils import assert_trains_like_one_process, run_ranks
from test_zero3 import _train

STEPS, GLOBAL_BATCH, REPLICAS, SHARDS = 3, 8, 2, 2


def _hybrid_groups(rank, how):
    """(shard group, replicate group) for 2 replicas x 2 shards: ranks {0,1} and {2,3} shard,
    {0,2} and {1,3} replicate; built by hand or by init_device_mesh (replicate, shard)."""
    if how == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("replicate", "shard"))
        return mesh, None
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicate_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return shard_groups[rank // SHARDS], replicate_groups[rank % SHARDS]


def _shard_hybrid(model, rank, how, **kw):
    first, second = _hybrid_groups(rank, how)
    if how == "mesh":
        return zero3.shard(model, mesh=first, **kw)
    return zero3.shard(model, first, replicate_group=second, **kw)


def _hybrid_training(rank, world, kind, autocast, how):
    torch.manual_seed(0)
    model = GPT(layers=2)
    reference = copy.deepcopy(model)
    batches = [torch.randint(0, 64, (GLOBAL_BATCH, 16)) for _ in range(STEPS)]
    per_rank = GLOBAL_BATCH // world
    local = [b[rank * per_rank:(rank + 1) * per_rank] for b in batches]
    if rank >= SHARDS:  # the second replica starts from other values: shard() must equalize
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)

    _shard_hybrid(model, rank, how)
    shards = {p.numel() for p in model.parameters()}
    run = model if kind == "uncompiled" else torch.compile(model, backend=dcr.backend(kind))
    losses = _train(model, local, autocast, run)
    ref_losses = _train(reference, batches, autocast)

    assert_trains_like_one_process(model, reference, losses, ref_losses, autocast, world)
    # The replicas hold the same shards, bit for bit (the same averaged gradient everywhere).
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    other = torch.empty_like(mine)
    peer = rank ^ SHARDS  # the same shard on the other replica
    ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, other, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert torch.equal(mine, other), "the replicas diverged"
    assert all(p.numel() * SHARDS >= q.numel() for p, q in zip(model.parameters(),
                                                                reference.parameters()))
    assert len(shards) > 1
    if kind != "uncompiled":
        reps = dcr.reports()
        assert reps, "the partitioner did not run"
        collectives = [c for r in reps for c in r.collectives]
        assert any(c.startswith("bw:dcr::allreduce_replicas") for c in collectives), collectives
        assert any(c.startswith("bw:dcr::allgather_cast") for c in collectives), \
            "the backward should re-gather"


# The hybrid gradient path is the same under both backends; inductor runs once, under bf16
# (fp32 under inductor is test_zero3's; an inductor-fp32 case here repeated both, 80 s).
@pytest.mark.parametrize("kind,autocast", [("eager", False), ("eager", True), ("inductor", True)],
                         ids=["eager-fp32", "eager-bf16", "inductor-bf16"])
def test_hybrid_training_matches_one_process(kind, autocast):
    """Guards HSDP's gradient: reduce-scattered within the shard group and averaged across the
    replicas, it must equal one process's on the global batch (a missing or doubled replica
    average, or replicas that start apart, changes the loss within 3 steps)."""
    run_ranks(_hybrid_training, 4, kind, autocast, "mesh" if autocast else "groups")


def test_hybrid_training_uncompiled():
    """Guards the eager (uncompiled) path of the same gradient: the gather's autograd
    backward runs average_over_replicas outside any graph too."""
    run_ranks(_hybrid_training, 4, "uncompiled", False, "groups")


def _hybrid_checkpoint(rank, world, tmp):
    torch.manual_seed(0)
    model = _shard_hybrid(GPT(layers=2), rank, "groups")
    idx = torch.randint(0, 64, (2, 16))
    _train(model, [idx], False)
    state = model.state_dict()  # full tensors, gathered within the shard group
    if rank == 0:
        torch.save(state, f"{tmp}/ckpt.pt")
    dist.barrier()
    torch.manual_seed(1)  # other initial values: the load must overwrite them
    fresh = _shard_hybrid(GPT(layers=2), rank, "mesh")
    fresh.load_state_dict(torch.load(f"{tmp}/ckpt.pt"))
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0, msg=name)
    for a, b in zip(model.parameters(), fresh.parameters()):  # the shards themselves
        assert torch.equal(a.detach(), b.detach())
    with zero3.gathered_parameters(fresh, modifier_rank=0):
        with torch.no_grad():
            fresh.head.weight.fill_(float(rank))
    assert torch.equal(fresh.state_dict()["head.weight"], torch.zeros_like(state["head.weight"]))


def test_hybrid_checkpoints_save_and_load(tmp_path):
    """Guards checkpoints under hybrid sharding: state_dict() gathers full tensors within the
    shard group, load_state_dict() re-shards them on every replica (into a mesh-sharded model),
    and gathered_parameters(modifier_rank=0) leaves every replica with rank 0's values."""
    run_ranks(_hybrid_checkpoint, 4, str(tmp_path))


def _bad_groups(rank, world):
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = shard_groups[rank // SHARDS]
    with pytest.raises(ValueError, match="share ranks"):
        zero3.shard(GPT(layers=1), mine, replicate_group=mine)
    with pytest.raises(ValueError, match="replicate_group= or a 2-D mesh="):
        zero3.shard(GPT(layers=1), mine)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (REPLICAS, SHARDS))
    with pytest.raises(ValueError, match="either mesh= or group="):
        zero3.shard(GPT(layers=1), mine, mesh=mesh)
    zero3.shard(GPT(layers=1), mesh=mesh)
    with pytest.raises(ValueError, match="already holds parameters replicated"):
        zero3.shard(GPT(layers=1), mesh.get_group(1), group_is_data_parallel=True)  # flat


def test_bad_hybrid_groups_are_refused():
    """Guards against gradients averaged over the wrong ranks: a replicate group that shares
    more than this rank with the shard group, a shard group short of the world without
    replicas, mesh= with group=, and one shard group used flat after hybrid, are errors."""
    run_ranks(_bad_groups, 4)
