"""Runs a test function on N ranks over gloo (the harness's rank spawner, a free local port)."""
import copy
import faulthandler
import os

import torch
import torch.distributed as dist

from dcr_bench.harness.ranks import RanksTimedOut, free_port, spawn_for_rows
from deepcompile_remat.zero3.custom_ops import (barrier_before_exit, release_in_flight,
                                                resolve_group)
from deepcompile_remat.zero3.shard import specs_of


def _entry(rank, world, port, fn, args, backend="gloo"):
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    faulthandler.enable()  # a crash on a rank prints where it happened
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        fn(rank, world, *args)
        if dist.is_initialized():
            # Drain every collective still queued on the group (gloo's barrier waits for all
            # prior work): DeepSpeed's prefetching gathers are never waited when no forward
            # follows, and a gloo work that finishes during interpreter finalization aborts the
            # process. A plain dist.barrier() can abort it the same way (docs/DESIGN.md,
            # "Teardown").
            barrier_before_exit()
    finally:
        # No work of ours outlives the group; no wait: a rank that failed mid-step must not hang.
        release_in_flight(wait=False)
        if dist.is_initialized():  # fn may destroy the group itself (test_teardown)
            dist.destroy_process_group()


RANKS_TIMEOUT_S = 300.0


def run_ranks(fn, world: int = 2, *args, timeout_s: float = RANKS_TIMEOUT_S,
              backend: str = "gloo") -> None:
    """fn(rank, world, *args) on `world` processes whose default group has `backend`; an
    assertion on any rank fails the test, and so does a run past timeout_s (ranks that disagree
    hang in a collective)."""
    try:
        spawn_for_rows(_entry, world, world, free_port(), fn, args, backend, timeout_s=timeout_s)
    except RanksTimedOut:
        raise AssertionError(
            f"{fn.__name__} on {world} ranks did not finish in {timeout_s:.0f} s: a hang "
            "(ranks waiting in mismatched collectives?)") from None


def full_grads(model) -> dict:
    """name -> the full gradient of each sharded parameter, gathered from every rank."""
    out = {}
    for mod_name, mod in model.named_modules():
        for name, spec in specs_of(mod).items():
            g = mod._parameters[name].grad
            parts = [torch.zeros_like(g) for _ in range(spec.world_size)]
            dist.all_gather(parts, g, group=resolve_group(spec.group_name))
            out[f"{mod_name}.{name}".lstrip(".")] = torch.cat(parts)[: spec.numel].view(spec.shape)
    return out


def assert_trains_like_one_process(model, reference, losses, ref_losses, autocast: bool,
                                   world: int) -> None:
    """Each step's loss, averaged over ranks, and the final (gathered) state equal one
    unsharded process's, within autocast's tolerance under autocast and fp32's otherwise."""
    tol = dict(rtol=3e-2, atol=3e-2) if autocast else dict(rtol=1e-4, atol=1e-5)
    for step, (mine, ref) in enumerate(zip(losses, ref_losses)):
        dist.all_reduce(mine)
        torch.testing.assert_close(mine / world, ref, **tol, msg=lambda m: f"step {step}: {m}")
    full = model.state_dict()  # gathered on every rank
    for name, ref in reference.state_dict().items():
        torch.testing.assert_close(full[name], ref, **tol, msg=lambda m: f"{name}: {m}")


def gpt_and_batches(rank, world, layers=2, steps=3, global_batch=8, seq=16):
    """(a seeded GPT, its unsharded copy: the one-process reference, `steps` global batches of
    token ids, this rank's data-parallel slice of each)."""
    from dcr_bench.harness.models import GPT

    torch.manual_seed(0)
    model = GPT(layers=layers)
    reference = copy.deepcopy(model)
    batches = [torch.randint(0, 64, (global_batch, seq)) for _ in range(steps)]
    per_rank = global_batch // world
    return model, reference, batches, [b[rank * per_rank:(rank + 1) * per_rank] for b in batches]
