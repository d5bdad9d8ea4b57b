"""DeepSpeed on CPU ranks for the tests: the rank environment, a ZeRO-3 config with or without
the "deepcompile_remat" block, and checks that read DeepSpeed's own state."""
import os

import torch


def rank_env(rank, world):
    """What DeepSpeed reads to find its rank (the launcher would set these)."""
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))


def ds_config(precision, on, kind="eager", *, micro_batch=2, clipping=1.0, **extra):
    """ZeRO-3, nothing persistent (every parameter gathered on use), bf16 parameters
    ("bf16") or fp32 ones under torch autocast ("autocast"); the block on or off."""
    cfg = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
           "gradient_clipping": clipping, "steps_per_print": 10 ** 6,
           "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    else:
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    cfg["deepcompile_remat"] = {"enabled": on, "backend": kind}
    cfg.update(extra)
    return cfg


def full_fp32_params(engine):
    """The fp32 master weights, gathered (every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def assert_weights_match_and_moved(full, ref, initial, *, atol, min_move, rtol=0.0):
    """Every trained weight within atol (+ rtol of its value) of the reference run's, and some
    weight moved by more than min_move from its initial value (else the comparison passes
    vacuously)."""
    moved = 0.0
    for name, want in ref.items():
        torch.testing.assert_close(full[name], want, rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name}: {m}")
        moved = max(moved, (full[name] - initial[name]).abs().max().item())
    assert moved > min_move, f"weights moved by {moved} at most: the comparison would be vacuous"


def assert_deepspeed_never_gathered(engine):
    """After a takeover DeepSpeed's own gathers must never run: every parameter stays an empty
    placeholder."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for name, p in engine.module.named_parameters():
        assert p.ds_status == ZeroParamStatus.NOT_AVAILABLE and p.data.numel() == 0, \
            f"{name}: DeepSpeed gathered it ({p.ds_status}, {p.data.numel()} elements)"
