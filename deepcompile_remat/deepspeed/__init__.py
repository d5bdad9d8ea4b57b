"""DeepSpeed integration: one block in the ds_config, the engine API unchanged.

    engine, *_ = deepcompile_remat.deepspeed.initialize(model=model, optimizer=opt,
                                                        config="configs/zero3_remat.json")

config.py      the "deepcompile_remat" block -> RematConfig: config_from_deepspeed; load();
               a misnamed/misplaced block refused; what the takeover does not implement
engine.py      initialize(): deepspeed.initialize, then the takeover when the block is enabled;
               install() / uninstall(): every caller of deepspeed.initialize gets ours
takeover.py    ZeRO-3 parameters as our traced gathers, gradients into DeepSpeed's partitions
deepcompile.py with DeepCompile on (CUDA): our partitioner in place of DeepSpeed's
_ds_internals.py  every private DeepSpeed attribute used, in one place (deepspeed 0.19.8)

Only engine.py/takeover.py/deepcompile.py import deepspeed, and only when called: reading a
config block needs no DeepSpeed installed.
"""
from deepcompile_remat.deepspeed.config import BLOCK, config_from_deepspeed
from deepcompile_remat.deepspeed.engine import initialize, install, installed, uninstall

__all__ = ["BLOCK", "config_from_deepspeed", "initialize", "install", "installed", "uninstall"]
