"""The process-group layout is in the compile-cache key (zero3/topology.py, issue 43 item 2).

Before: RematPartitioner.uuid() held the sources, the config and the parameter layout, not the
groups the runtime's passes read. Job A (an MLP sharded with node-local re-gathers from
secondary groups) filled a cache; job B (the same script without a secondary group, other
groups created first, so the names A's secondary groups had now name other ranks) was served
A's graphs: on 4 ranks it failed resolving group "1"; where the name resolved it re-gathered
over whatever ranks the name held. Each job here is a fresh set of 2 rank processes with
torch's caches on, in one cache folder (2 ranks: the secondary groups are single ranks, the
smallest proper divisor of 2; the key is the same function of any layout).
"""
import json
import os

import torch
import torch.distributed as dist

import deepcompile_remat as dcr
from deepcompile_remat import backends, zero3
from deepcompile_remat.zero3.topology import GroupRef, ShardGroup, Topology
from dist_utils import assert_trains_like_one_process, run_ranks

STEPS = 3


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))


def _train(model, batches, run):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x in batches:
        loss = run(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _job(rank, world, cache_dir, layout, out_dir):
    """One training job with the caches on in cache_dir; writes this rank's cache counters."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == cache_dir
    inductor_config.fx_graph_cache = True  # the rank entry turns them off: on again
    functorch_config.enable_autograd_cache = True
    if layout == "secondary":  # groups "1" and "2": {0} and {1}
        node, _ = dist.new_subgroups(1)
        kwargs = {"secondary_group": node}
    else:  # names "1" and "2" now hold {0, 1}
        dist.new_group([0, 1])
        dist.new_group([0, 1])
        kwargs = {}
    model, reference = _mlp(), _mlp()
    zero3.shard(model, **kwargs)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(4 * world, 32, generator=gen) for _ in range(STEPS)]
    local = [b.chunk(world)[rank] for b in batches]
    run = torch.compile(model, backend=dcr.backend("inductor"))
    losses = _train(model, local, run)
    ref_losses = _train(reference, batches, reference)
    assert_trains_like_one_process(model, reference, losses, ref_losses, False, world)
    hits = counters["aot_autograd"]["autograd_cache_hit"]
    misses = counters["aot_autograd"]["autograd_cache_miss"]
    with open(os.path.join(out_dir, f"{layout}-{rank}.json"), "w") as f:
        json.dump({"hits": hits, "misses": misses}, f)


def _run(tmp_path, layout, monkeypatch):
    """One job (2 ranks); each rank's cache counters. The environment forces the caches (the
    suite's conftest forces them off) and is read when a rank imports torch."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    # A job of new processes each time, as a user's jobs are: only the disk cache is shared.
    run_ranks(_job, 2, str(tmp_path / "cache"), layout, str(out), fresh=True)
    return [json.loads((out / f"{layout}-{r}.json").read_text()) for r in range(2)]


def test_two_layouts_on_one_cache_both_train(tmp_path, monkeypatch):
    """Job A fills the cache, job B (another layout, same model and script) misses it and
    trains like one process, and job A again hits (the cache is live: the test can fail)."""
    first = _run(tmp_path, "secondary", monkeypatch)
    assert all(c["misses"] >= 1 and c["hits"] == 0 for c in first), first
    other = _run(tmp_path, "plain", monkeypatch)
    assert all(c["hits"] == 0 and c["misses"] >= 1 for c in other), other
    again = _run(tmp_path, "secondary", monkeypatch)
    assert all(c["hits"] >= 1 for c in again), again


def _key(world, secondary=None, ranks=None):
    ranks = tuple(range(world)) if ranks is None else ranks
    sec = None if secondary is None else GroupRef("1", secondary)
    return backends.RematPartitioner(
        dcr.RematConfig(), (0, 1), 3,
        topology=Topology(world, (ShardGroup(GroupRef("0", ranks), None, sec),))).uuid()


def test_the_cache_key_changes_with_world_size_and_secondary_layout():
    """Only the topology differs: world size, the secondary group's ranks under the same
    name, or the shard group's ranks under the same name: each gives another key."""
    base = _key(4, (0, 1))
    assert base == _key(4, (0, 1))
    assert len({base, _key(8, (0, 1)), _key(4, (2, 3)), _key(4), _key(4, (0, 1), (0, 1, 2, 4))}
               ) == 5


def _dynamo_graph_topology(rank, world):
    from deepcompile_remat.zero3.topology import topology_of

    node, _ = dist.new_subgroups(1)  # a block of one rank: the smallest proper divisor of 2
    model = _mlp()
    zero3.shard(model, secondary_group=node)
    seen = []

    def backend(gm, example_inputs):
        seen.append(topology_of(gm))
        return gm.forward

    torch.compile(model, backend=backend)(torch.randn(2, 32))
    # The same model inside an activation-checkpoint region: its gathers are in a subgraph
    checkpointed = torch.compile(
        lambda x: torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False),
        backend=backend)
    checkpointed(torch.randn(2, 32))
    assert len(seen) == 2
    for topology in seen:
        [group] = topology.shard_groups
        assert topology.world_size == world and group.group.ranks == (0, 1), topology
        assert group.secondary is not None and group.secondary.ranks == (rank,), topology
        assert topology.secondary_of(group.group.name) == (1, group.secondary.name)
        assert f"s:{group.secondary.name}[{rank}]" in topology.key()
        assert topology.spans_ranks()


def test_the_topology_is_read_from_the_graph_dynamo_hands_the_backend():
    """Silent bugs guarded: Dynamo's graphs call the op packet (torch.ops.dcr.allgather_cast),
    not an overload, and a reader that only knew overloads found no group at all, so every
    layout had one key; and a checkpoint region's gathers are in a subgraph, which a reader
    of the top graph alone missed (the same one key, and no agreement on the cut)."""
    run_ranks(_dynamo_graph_topology, 2)
