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
    store = dist.HashStore()
    first = agreement.agree(store, "k", [3, 1], np.array([1, 2, 0, 4], np.uint8), rank=1)
    assert first[0] == [3, 1] and first[2] == 1
    saved, info, by = agreement.agree(store, "k", [2], np.array([0, 0, 1, 1], np.uint8), rank=0)
    assert (saved, info.tolist(), by) == ([3, 1], [1, 2, 0, 4], 1)
    with pytest.raises(RuntimeError, match="graph of 4 nodes, this one has 2"):
        agreement.agree(store, "k", [0], np.zeros(2, np.uint8), rank=0)
    # A store without compare_set (torch's FakeStore): this rank's own cut, said once
    from torch.testing._internal.distributed.fake_pg import FakeStore

    agreement._warn_no_agreement.cache_clear()
    with caplog.at_level("WARNING", logger=agreement.__name__):
        for _ in range(2):
            assert agreement.agree(FakeStore(), "k", [2], np.zeros(3, np.uint8), rank=0)[:1] \
                == ([2],)
    assert [r.getMessage().count("cannot compare_set") for r in caplog.records] == [1]
    # No store (one process): this rank's own cut, and no rank named
    assert agreement.agreed_cut(_exported(2), [0], np.zeros(3, np.uint8), context="c",
                                spans_ranks=True, store=None)[2] is None


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.down = nn.Linear(32, 8)

    def forward(self, x):
        return self.down(self.norm(torch.nn.functional.gelu(self.up(x)) * 1.5)).square().mean()


def _ranks_cutting_differently(rank, world):
    """Rank 1 cuts with the aggressive policy (its own cut differs from rank 0's, as a cut
    that sizes flip would), at a batch of its own size; the ranks still run one cut, and
    train like one process."""
    import copy

    from deepcompile_remat.partition import cut
    from deepcompile_remat.zero3 import shard

    own = []
    decide = cut.decide

    def decide_as_this_rank(graph, config):
        policy = "aggressive" if rank == 1 else config.policy
        result = decide(graph, dataclasses.replace(config, policy=policy))
        own.append(sorted(int(i) for i in result[0]))
        return result

    cut.decide = decide_as_this_rank
    try:
        torch.manual_seed(0)
        model = _Net()
        reference = copy.deepcopy(model)
        shard(model)
        compiled = torch.compile(model, backend=dcr.backend("eager"))
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
        cut.decide = decide
    every_own = [None] * world
    dist.all_gather_object(every_own, own)
    assert every_own[0] != every_own[1], "the test needs ranks whose own cuts differ"
    assert_one_cut_on_every_rank(world)
    assert_trains_like_one_process(model, reference, losses, ref_losses, False, world)


def test_ranks_whose_own_cuts_differ_run_one_cut():
    run_ranks(_ranks_cutting_differently, 2)


@pytest.mark.parametrize("mode", ["prefetch_budget_bytes", "memory_budget", "peak_target", None])
def test_settings_that_are_not_agreed_say_so_once(caplog, mode):
    """A prefetch byte budget (the distance orders the gathers among the backward's
    reduce-scatters), memory_budget and peak_target read this rank's sizes in more ways than
    the cut (simulated peaks, budgets in bytes, bucket searches) and are not agreed: where a
    graph's collectives span ranks, each says so once a process; the defaults say nothing."""
    from functorch.compile import aot_function

    from deepcompile_remat.zero3.topology import GroupRef, ShardGroup, Topology

    two_ranks = Topology(2, (ShardGroup(GroupRef("0", (0, 1))),))
    config = dcr.RematConfig(**({mode: 1.0} if mode else {}))
    agreement.warn_reads_sizes.cache_clear()
    with caplog.at_level("WARNING", logger=agreement.__name__):
        for rows in (4, 6):
            fn = aot_function(lambda x, w: torch.sin(x @ w).cos().sum(), fw_compiler=_nop,
                              partition_fn=dcr.make_partition_fn(config, topology=two_ranks))
            fn(torch.randn(rows, 8), torch.randn(8, 8, requires_grad=True)).backward()
    said = [r.getMessage() for r in caplog.records if "ranks do not agree" in r.getMessage()]
    if mode is None:
        assert not said
    else:
        assert len(said) == 1 and mode in said[0], said


def _nop(gm, _inputs):
    from functorch.compile import make_boxed_func

    return make_boxed_func(gm.forward)
