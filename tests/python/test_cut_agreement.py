"""Ranks agree on one ordinary cut per graph structure (planning/agreement.py): under per-rank
padding each rank's first graph is static at its own size, and a cut that sizes flip could
change which parameters the backward re-gathers, so the ranks' collectives."""
import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import deepcompile_remat as dcr
from deepcompile_remat.partition import fx_export
from deepcompile_remat.planning import agreement
from dist_utils import assert_trains_like_one_process, run_ranks
from graph_checks import assert_one_cut_on_every_rank


def _exported(rows: int, width: int = 8):
    def step(x, w):
        return (torch.sin(x @ w) * 2).sum()

    joint = make_fx(step)(torch.randn(rows, width), torch.randn(width, width))
    return fx_export.export_joint_graph(joint, num_fwd_outputs=1, parameter_indices=[1])


def test_the_key_is_the_structure_without_activation_bytes():
    """Other activation sizes: the same key. Another parameter size, context or structure:
    another key (the cut taken from another rank must be legal here, and for this layer)."""
    small, large = _exported(2), _exported(300)
    assert not np.array_equal(small.bytes, large.bytes)
    assert agreement.structure_key(small, "c") == agreement.structure_key(large, "c")
    assert agreement.structure_key(small, "c") != agreement.structure_key(small, "d")
    assert agreement.structure_key(small, "c") != agreement.structure_key(_exported(2, 16), "c")


def test_the_first_cut_offered_is_the_one_every_rank_takes(caplog):
    from deepcompile_remat.partition.report import BudgetSummary

    Cut = agreement.Cut
    store = dist.HashStore()
    budget = BudgetSummary(*range(6))  # memory_budget's figures travel with the cut
    first, by = agreement.agree(store, "k", Cut([3, 1], np.array([1, 2, 0, 4]), budget), rank=1)
    assert first.saved == [3, 1] and by == 1
    taken, by = agreement.agree(store, "k", Cut([2], np.array([0, 0, 1, 1])), rank=0)
    assert (taken.saved, taken.info.tolist(), taken.budget, by) == ([3, 1], [1, 2, 0, 4],
                                                                    budget, 1)
    with pytest.raises(RuntimeError, match="graph of 4 nodes, this one has 2"):
        agreement.agree(store, "k", Cut([0], np.zeros(2)), rank=0)
    # A store without compare_set (torch's FakeStore): this rank's own cut, said once
    from torch.testing._internal.distributed.fake_pg import FakeStore

    agreement._warn_no_agreement.cache_clear()
    with caplog.at_level("WARNING", logger=agreement.__name__):
        for _ in range(2):
            assert agreement.agree(FakeStore(), "k", Cut([2], np.zeros(3)), 0)[0].saved == [2]
    assert [r.getMessage().count("cannot compare_set") for r in caplog.records] == [1]
    # No store (one process): this rank's own cut, and no rank named
    assert agreement.agreed_cut(_exported(2), Cut([0], np.zeros(3)), context="c",
                                spans_ranks=True, store=None)[1] is None


def test_a_served_compile_offers_its_cut_buckets_and_distances():
    """What served_cuts_agree does with the reports kept for a compile torch's AOTAutograd
    cache served (the backend compiles again where it returns None): each agreed choice is
    offered again; one that differs from the job's (its cut, peak_target's buckets or a
    prefetch budget's distances) refuses the hit, as does a hit without a kept report."""
    from functorch.compile import aot_function

    from deepcompile_remat.backends import eager_graph_compiler

    fn = aot_function(lambda x, w: torch.sin(x @ w).cos().sum(),
                      fw_compiler=eager_graph_compiler(), partition_fn=dcr.make_partition_fn())
    fn(torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)).backward()
    [base] = dcr.reports()

    def served(key, saved, buckets=None, distances=None):
        return dataclasses.replace(base, from_cache=True, agreed=(
            key, tuple(saved), bytes([0, 1, 2]), buckets, distances))

    store, agree = dist.HashStore(), agreement.served_cuts_agree
    first = agree([served("a", [1, 2], (8.0, 8.0), (2, 2))], spans_ranks=True, store=store,
                  rank=1)
    assert [r.cut_by_rank for r in first] == [1]  # offered first: the job's
    assert agree([served("a", [1, 2], (8.0, 8.0), (2, 2))], spans_ranks=True, store=store,
                 rank=0)[0].cut_by_rank == 1
    for other in (served("a", [1]), served("a", [1, 2], (32.0, 32.0), (2, 2)),
                  served("a", [1, 2], (8.0, 8.0), (0, 2))):
        assert agree([other], spans_ranks=True, store=store, rank=0) is None, other.agreed
    assert agree([], spans_ranks=True, store=store, rank=0) is None
    assert agree([], spans_ranks=False, store=store, rank=0) == ()  # one rank: nothing to agree
    assert agree([base], spans_ranks=True, store=store, rank=0) == (base,)  # not agreed


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.down = nn.Linear(32, 8)

    def forward(self, x):
        return self.down(self.norm(torch.nn.functional.gelu(self.up(x)) * 1.5)).square().mean()


def _sharded_net():
    """(the net sharded over the group, an unsharded copy of it: the reference)."""
    import copy

    from deepcompile_remat.zero3 import shard

    torch.manual_seed(0)
    model = _Net()
    reference = copy.deepcopy(model)
    return shard(model), reference


def _ranks_cutting_differently(rank, world, mode):
    """Rank 1 cuts with the aggressive policy, or under memory_budget, peak_target or
    prefetch_budget_bytes with another budget or target (its own choice differs from rank
    0's, as one that sizes flip would), at a batch of its own size; the ranks still run one
    choice, and train like one process."""
    from deepcompile_remat.partition import cut
    from deepcompile_remat.planning import peak_target
    from deepcompile_remat.zero3 import runtime

    own = []
    decide, plan, schedule = cut.decide, peak_target.plan, runtime.schedule_gathers

    def schedule_as_this_rank(gm, options, *, graph, **kwargs):
        if options.prefetch_distances is not None:  # the agreed distances
            return schedule(gm, options, graph=graph, **kwargs)
        budget = 0.0 if rank == 1 else options.prefetch_budget_bytes
        figures = schedule(gm, dataclasses.replace(options, prefetch_budget_bytes=budget),
                           graph=graph, **kwargs)
        own.append((graph, figures.prefetch_distance))
        return figures

    def decide_as_this_rank(graph, config):
        if mode == "ordinary":
            changed = {"policy": "aggressive" if rank == 1 else config.policy}
        else:
            changed = {"memory_budget": 0.0 if rank == 1 else config.memory_budget}
        result = decide(graph, dataclasses.replace(config, **changed))
        own.append(sorted(int(i) for i in result[0]))
        return result

    def plan_as_this_rank(graph, *, peak_target, **kwargs):
        chosen, summary = plan(graph, peak_target=0.5 if rank == 1 else peak_target, **kwargs)
        own.append((sorted(chosen.candidate.saved_ids), summary.bucket_bytes))
        return chosen, summary

    if mode == "prefetch_budget_bytes":
        runtime.schedule_gathers = schedule_as_this_rank
    else:
        cut.decide, peak_target.plan = decide_as_this_rank, plan_as_this_rank
    try:
        model, reference = _sharded_net()
        config = dcr.RematConfig(**{"ordinary": {}, "memory_budget": {"memory_budget": 1.0},
                                    "peak_target": {"peak_target": 1.0},
                                    "prefetch_budget_bytes": {"prefetch_budget_bytes": 1e12}
                                    }[mode])
        compiled = torch.compile(model, backend=dcr.backend("eager", config))
        batches = [torch.randn(3 + 40 * r, 16) for r in range(world)]  # 3 and 43 rows
        losses, ref_losses = [], []
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for _ in range(2):
            loss = compiled(batches[rank])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            ref_loss = sum(reference(b) for b in batches) / world
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(ref_loss.detach())
    finally:
        cut.decide, peak_target.plan, runtime.schedule_gathers = decide, plan, schedule
    every_own, distances = [None] * world, [None] * world
    dist.all_gather_object(every_own, own)
    assert every_own[0] != every_own[1], "the test needs ranks whose own choices differ"
    assert_one_cut_on_every_rank(world)
    dist.all_gather_object(distances, [f.prefetch_distance for r in dcr.reports()
                                       for f in r.schedule])
    assert distances[0] == distances[1], distances
    assert_trains_like_one_process(model, reference, losses, ref_losses, False, world)


@pytest.mark.parametrize("mode", ["ordinary", "memory_budget", "peak_target",
                                  "prefetch_budget_bytes"])
def test_ranks_whose_own_cuts_differ_run_one_cut(mode):
    run_ranks(_ranks_cutting_differently, 2, mode)


def _job_on_one_cache(rank, world, cache_dir, rows, offers_second, out_dir):
    """One job with torch's caches on in cache_dir: rank r trains on rows[r] rows, rank 1
    cuts with the aggressive policy (as a cut that sizes flip would), and rank
    `offers_second` offers its cut only once another rank has offered one (the order the
    test needs). Writes this rank's cache counters and reports."""
    import contextlib
    import datetime
    import json
    import os

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    from deepcompile_remat.partition import cut

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == cache_dir
    inductor_config.fx_graph_cache = True  # the rank entry turns them off: on again
    functorch_config.enable_autograd_cache = True
    decide, offer = cut.decide, agreement._offer

    def decide_as_this_rank(graph, config):
        policy = "aggressive" if rank == 1 else config.policy
        return decide(graph, dataclasses.replace(config, policy=policy))

    def offer_in_order(store, key, *args):
        if rank == offers_second:
            # the other rank's offer; none within the limit: the test's assertions fail, it
            # does not hang
            with contextlib.suppress(RuntimeError):
                store.wait([agreement.KEY_PREFIX + key], datetime.timedelta(seconds=90))
        return offer(store, key, *args)

    cut.decide, agreement._offer = decide_as_this_rank, offer_in_order
    try:
        model, reference = _sharded_net()
        compiled = torch.compile(model, backend=dcr.backend("inductor"))
        gen = torch.Generator().manual_seed(1)
        batches = [torch.randn(n, 16, generator=gen) for n in rows]
        loss = compiled(batches[rank])
        loss.backward()
        ref_loss = sum(reference(b) for b in batches) / world
        ref_loss.backward()
    finally:
        cut.decide, agreement._offer = decide, offer
    assert_one_cut_on_every_rank(world)
    assert_trains_like_one_process(model, reference, [loss.detach()], [ref_loss.detach()],
                                   False, world)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump({"hits": counters["aot_autograd"]["autograd_cache_hit"],
                   "by": [r.cut_by_rank for r in dcr.reports()],
                   "from_cache": [r.from_cache for r in dcr.reports()]}, f)


def _job(tmp_path, monkeypatch, name, cache, rows, offers_second):
    import json

    out = tmp_path / name
    out.mkdir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    run_ranks(_job_on_one_cache, 2, str(cache), rows, offers_second, str(out), fresh=True)
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


def test_a_rank_served_from_the_cache_runs_the_jobs_cut(tmp_path, monkeypatch):
    """A compile served from torch's AOTAutograd cache runs a cut agreed in an earlier job.
    Job 1 (ranks at 3 and 43 rows) agrees on rank 0's cut and caches it at both sizes. In
    job 2 rank 0 runs 43 rows (a cache hit with that cut) and rank 1 runs 7 (a miss; its own
    cut differs). Served first, rank 0's cut is the job's and rank 1 takes it; offered after
    rank 1's, rank 0 compiles again without that cache and takes rank 1's. Before, rank 0's
    hit offered nothing: the ranks ran different cuts."""
    import shutil

    first = _job(tmp_path, monkeypatch, "job1", tmp_path / "cache", (3, 43), offers_second=1)
    assert [c["by"] for c in first] == [[0], [0]] and not any(c["hits"] for c in first), first
    shutil.copytree(tmp_path / "cache", tmp_path / "cache2")
    served_first = _job(tmp_path, monkeypatch, "hit-first", tmp_path / "cache", (43, 7),
                        offers_second=1)
    assert served_first[0]["hits"] >= 1 and served_first[0]["from_cache"] == [True]
    assert served_first[1]["hits"] == 0 and [c["by"] for c in served_first] == [[0], [0]]
    served_second = _job(tmp_path, monkeypatch, "hit-second", tmp_path / "cache2", (43, 7),
                         offers_second=0)
    assert served_second[0]["hits"] >= 1 and served_second[0]["from_cache"] == [False]
    assert [c["by"] for c in served_second] == [[1], [1]], served_second
