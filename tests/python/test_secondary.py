"""Node-local re-gathers (zero3.shard(secondary_group=...), ZeRO++'s hpZ) on 4 gloo ranks (8
beside hybrid sharding) with secondary groups of 2 ({0,1}, {2,3}: "nodes" of two): training matches one unsharded process,
every backward gather runs within the secondary group from a secondary shard the forward
handed over, that shard is 1/2 of the gathered weight in the gathered dtype, and bad groups
are refused."""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import deepcompile_remat as dcr
from deepcompile_remat import zero3
from dcr_bench.harness.models import GPT
from dist_utils import assert_trains_like_one_process, gpt_and_batches, run_ranks
from graph_checks import assert_one_cut_on_every_rank, capture_partitions
from test_zero3 import _train

NODE = 2
GATHER_OPS = ("allgather_cast", "allgather_cast_start", "allgather_cast_bucket",
              "allgather_cast_bucket_start")


def _gather_nodes(gm):
    """(node, the shard nodes it gathers) of every gather in `gm` (single or bucket)."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "dcr" and (
                n.target._opname in GATHER_OPS):
            yield n, n.args[0] if isinstance(n.args[0], (list, tuple)) else [n.args[0]]


def _gathers(gm):
    """(world size, group name, numel of each shard gathered) of every gather in `gm`."""
    return [(n.args[1], n.args[2], [s.meta["val"].numel() for s in shards])
            for n, shards in _gather_nodes(gm)]


class _Checkpointed(nn.Module):
    """A block whose forward is one checkpoint region (Dynamo compiles it as a subgraph)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def _secondary_training(rank, world, kind, autocast, checkpointing, scope="model"):
    model, reference, batches, local = gpt_and_batches(rank, world, layers=2)

    node, _ = dist.new_subgroups(NODE)
    zero3.shard(model, secondary_group=node)
    if checkpointing and scope == "layers":  # a module per block, as HF's layers are
        for m in (model, reference):  # the reference too: the same state-dict names
            m.blocks = nn.ModuleList(_Checkpointed(block) for block in m.blocks)
    elif checkpointing:  # each block a checkpoint region: its forward gathers are redone too
        for block in model.blocks:
            block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward,
                                              use_reentrant=False)
    if scope == "layers":  # the README's dcr.compile: each block its own graph
        run = dcr.compile(model, dcr.RematConfig(), kind)
    else:
        run = torch.compile(model, backend=dcr.backend(kind))
    with capture_partitions() as graphs:
        losses = _train(model, local, autocast, run)
    ref_losses = _train(reference, batches, autocast)
    assert_trains_like_one_process(model, reference, losses, ref_losses, autocast, world)
    # One agreed cut on all 4 ranks, though each pair of ranks has its own secondary group
    assert_one_cut_on_every_rank(world)

    assert graphs, "the partitioner did not run"
    matrices = {p.numel() for p in model.parameters() if len(p.ds_shape) >= 2}
    vectors = {p.numel() for p in model.parameters() if len(p.ds_shape) < 2} - matrices
    for fw, bw, _ in graphs:
        forward, backward = _gathers(fw), _gathers(bw)
        assert forward and all(w == world and g == dist.group.WORLD.group_name
                               for w, g, _ in forward), forward
        # Every re-gather of a matrix stays in the node. Left on the world group: only vectors
        # (biases) that no backward op reads, regathered to redo a forward op the cut recomputes
        # (no secondary shard is kept for them: the joint graph shows no backward use).
        assert any(w == NODE and g == node.group_name for w, g, _ in backward), backward
        for w, g, numels in backward:
            assert (w, g) == (NODE, node.group_name) or set(numels) <= vectors, backward
        # Each weight once: the backward's own uses and a forward op the cut redoes share one
        # re-gather (two would move its bytes twice).
        sources = [s.name for _, shards in _gather_nodes(bw) for s in shards]
        assert len(sources) == len(set(sources)), sources
    figures = [f for r in dcr.reports() for f in r.schedule if f.graph == "bw"]
    assert figures and all(f.secondary_regathers > 0 for f in figures), figures
    # What stays in the node: each re-gather's full (padded) weight, counted in the figures
    # and the summary.
    for r, (_, bw, _) in zip(dcr.reports(), graphs):
        (fig,) = [f for f in r.schedule if f.graph == "bw"]
        local = [numels for w, g, numels in _gathers(bw) if (w, g) == (NODE, node.group_name)]
        assert fig.secondary_regathers >= len(local) > 0  # buckets join several
        assert "within the secondary group" in r.summary()
    # The secondary shards: half of each gathered (padded) weight, in the gathered dtype:
    # under autocast bf16 for the matmuls' weights (cast before the gather), fp32 for the
    # norms' (autocast runs norms in fp32).
    dtypes = {"bfloat16": 2, "float32": 4} if autocast else {"float32": 4}
    weights = {p.numel() * world // NODE for p in model.parameters()}
    for r in dcr.reports():
        secondaries = [s for s in r.saved if s.name.startswith("secondary_shard")]
        assert secondaries and all(s.dtype in dtypes and s.bytes // dtypes[s.dtype] in weights
                                   for s in secondaries), secondaries
        if autocast:
            assert any(s.dtype == "bfloat16" for s in secondaries), secondaries
        (bw,) = [f for f in r.schedule if f.graph == "bw"]
        assert bw.secondary_shard_bytes == sum(s.bytes for s in secondaries)


@pytest.mark.parametrize("kind,autocast", [("eager", False), ("inductor", True)],
                         ids=["eager-fp32", "inductor-bf16"])  # the two others: CI time
def test_secondary_regathers_train_like_one_process(kind, autocast):
    """Guards the node-local re-gather: a secondary shard sliced at the wrong offset, from the
    wrong group rank, or gathered in the wrong order gives a wrong weight in the backward and
    a wrong gradient within 3 steps; a re-gather left over the world group, or none kept, fails
    the graph checks."""
    run_ranks(_secondary_training, 4, kind, autocast, False)


def test_secondary_regathers_under_activation_checkpointing():
    """Guards the gathers the cut itself recomputes: under checkpointing the backward redoes
    each block's forward, whose gathers must read the secondary shards too (after the cut),
    not go back over the world group."""
    run_ranks(_secondary_training, 4, "inductor", True, True)


def test_secondary_regathers_per_layer_under_activation_checkpointing():
    """Silent bug guarded: with each block compiled on its own and checkpointed, all of a
    graph's gathers sit in the checkpoint region's subgraph; the topology, read from the top
    graph only, had no group, so no secondary shard was kept and every re-gather crossed the
    world group."""
    run_ranks(_secondary_training, 4, "eager", False, True, "layers")


def _bad_secondary_groups(rank, world):
    node, _ = dist.new_subgroups(NODE)
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    with pytest.raises(ValueError, match="block of 2 consecutive ranks"):
        zero3.shard(GPT(layers=1), secondary_group=pairs[rank % 2])
    with pytest.raises(ValueError, match="must divide the shard group's"):
        zero3.shard(GPT(layers=1), secondary_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="not a member of the secondary group"):
        zero3.shard(GPT(layers=1), secondary_group=pairs[1 - rank % 2])
    zero3.shard(GPT(layers=1), secondary_group=node)
    with pytest.raises(ValueError, match="already re-gathers within another secondary group"):
        zero3.shard(GPT(layers=1), secondary_group=None)


def test_bad_secondary_groups_are_refused():
    """Guards against a weight put together from the wrong slices: a secondary group that is
    not this rank's block of consecutive shard-group ranks, one as large as the shard group,
    one without this rank, and one shard group given two secondary settings, are errors
    naming the groups."""
    run_ranks(_bad_secondary_groups, 4)


def _secondary_inside_hybrid(rank, world):
    model, reference, batches, local = gpt_and_batches(rank, world, layers=1)
    # 8 ranks: 2 replicas (ranks 0-3, 4-7) x shard groups of 4, each made of 2 "nodes" of 2.
    shards = [dist.new_group(list(range(i, i + 4))) for i in (0, 4)]
    replicas = [dist.new_group([i, i + 4]) for i in range(4)]
    node, _ = dist.new_subgroups(NODE)
    zero3.shard(model, shards[rank // 4], replicate_group=replicas[rank % 4],
                secondary_group=node)
    run = torch.compile(model, backend=dcr.backend("eager"))
    with capture_partitions() as graphs:
        losses = _train(model, local, False, run)
    assert_trains_like_one_process(model, reference, losses, _train(reference, batches, False),
                                   False, world)
    for fw, bw, _ in graphs:
        assert {(w, g) for w, g, _ in _gathers(fw)} == {(4, shards[rank // 4].group_name)}
        vectors = {p.numel() for p in model.parameters() if len(p.ds_shape) < 2}
        assert (NODE, node.group_name) in {(w, g) for w, g, _ in _gathers(bw)}
        assert all((w, g) == (NODE, node.group_name) or set(numels) <= vectors
                   for w, g, numels in _gathers(bw)), _gathers(bw)
        assert any(n.op == "call_function" and "allreduce_replicas" in str(n.target)
                   for n in bw.graph.nodes)


def test_secondary_regathers_inside_hybrid_sharding():
    """Node-local re-gathers beside hybrid sharding (shard over 2 nodes, replicate across the
    pairs, re-gather within each node), 8 ranks: trains like one process; the forward gathers
    over the shard group, the backward re-gathers in the node and averages over the
    replicas."""
    run_ranks(_secondary_inside_hybrid, 8)


def _secondary_under_a_budget(rank, world, budget):
    model, reference, batches, local = gpt_and_batches(rank, world, layers=2)
    node, _ = dist.new_subgroups(NODE)
    zero3.shard(model, secondary_group=node)
    run = torch.compile(model, backend=dcr.backend("eager", dcr.RematConfig(memory_budget=budget)))
    with capture_partitions() as graphs:
        losses = _train(model, local, False, run)
    assert_trains_like_one_process(model, reference, losses, _train(reference, batches, False),
                                   False, world)
    (rep,) = dcr.reports()
    (fig,) = [f for f in rep.schedule if f.graph == "bw"]
    (fw, bw, _), = graphs
    kept = [s for s in rep.saved if s.name.startswith("secondary_shard")]
    if budget == 0:
        # The least memory: no secondary shard is kept, every weight is re-gathered from its
        # shard over the world (once), and the report says so.
        assert kept == [] and fig.secondary_regathers == 0 and fig.secondary_dropped > 0
        assert {(w, g) for w, g, _ in _gathers(bw)} == {(world, dist.group.WORLD.group_name)}
        assert "not kept: the memory budget" in rep.summary()
        assert not any("secondary_shard" in str(n.target) for n in bw.graph.nodes)
    else:
        # A budget that fits them: every matrix's secondary shard is kept, as without one.
        assert kept and fig.secondary_dropped == 0 and fig.secondary_regathers > 0
        assert rep.budget.saved_bytes <= rep.budget.saved_bytes_budget


@pytest.mark.parametrize("budget", [0, 1.0])
def test_a_memory_budget_bounds_the_secondary_shards(budget):
    """memory_budget counts the secondary shards and may give them up: each is priced as the
    re-gather across nodes it saves (FLOPS_PER_CROSSING_BYTE), so the sweep drops them only
    where the budget needs their bytes, and then the backward re-gathers that weight from its
    shard over the shard group. budget 0 (the least memory): none kept, training still equals
    one process; budget 1.0 (the default cut's bytes): all kept."""
    run_ranks(_secondary_under_a_budget, 4, budget)
