"""DeepSpeed integration: one block in the ds_config, the engine API unchanged.

    engine, *_ = deepcompile_remat.deepspeed.initialize(model=model, optimizer=opt,
                                                        config="configs/zero3_remat.json")

config.py      the ds_config read once: DeepSpeedSettings (the block's RematConfig among them);
               config_from_deepspeed; load(); a misnamed/misplaced block refused; what the
               takeover does not implement
adapter.py     DeepSpeedAdapter: every patch of DeepSpeed made, recorded and undone in one
               place; the start-up check that each DeepSpeed attribute used exists (0.19.8)
engine.py      initialize(): deepspeed.initialize, then the takeover when the block is enabled;
               install() / uninstall(): every caller of deepspeed.initialize gets ours
takeover.py    ZeRO-3 parameters as our traced gathers, gradients into DeepSpeed's partitions
optimizer_step.py  DeepSpeed's optimizer step holding only what it reads
deepcompile.py with DeepCompile on (CUDA): our partitioner in place of DeepSpeed's
_ds_internals.py  DeepSpeed's data the takeover frees, re-points and brings back
autoinstall.py never silently off: deepspeed.initialize wrapped as DeepSpeed is imported, so
               an enabled block without install() is taken over (a warning) or, under
               DCR_AUTOINSTALL=0, refused; _import_hook.py, loaded at interpreter start by
               deepcompile_remat_autoinstall.pth (site-packages), waits for `import deepspeed`

DeepSpeed is imported only when called: reading a config block needs no DeepSpeed installed.
"""
from deepcompile_remat.deepspeed.config import BLOCK, config_from_deepspeed
from deepcompile_remat.deepspeed.engine import initialize, install, installed, uninstall

__all__ = ["BLOCK", "config_from_deepspeed", "initialize", "install", "installed", "uninstall"]
