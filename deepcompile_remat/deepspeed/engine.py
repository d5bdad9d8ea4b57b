"""initialize(): deepspeed.initialize, with the "deepcompile_remat" block honoured.

    engine, optimizer, loader, scheduler = deepcompile_remat.deepspeed.initialize(
        model=model, optimizer=opt, config="configs/zero3_remat.json")
    loss = engine(batch); engine.backward(loss); engine.step(); engine.save_checkpoint(dir)

Block absent or disabled: exactly deepspeed.initialize(...) with the arguments as given.
Enabled: ZeRO stage 3 is required (an error otherwise, before any engine is built); the block
is removed from the config DeepSpeed sees; then either
  - DeepCompile off: take_over() (takeover.py) puts the engine's parameters under our traced
    gathers and compiles the module with our backend, or
  - DeepCompile on (CUDA only): DeepCompile runs ZeRO-3 and we replace its partitioner
    (deepcompile.py); the engine is compiled with the block's backend.
The returned tuple is deepspeed.initialize's; the takeover is at engine.dcr_takeover.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping

from deepcompile_remat.deepspeed.config import BLOCK, DeepSpeedBlock, load, parse_block


def _config_of(args, config, config_params):
    """The config deepspeed.initialize would read, as (value, which argument held it)."""
    if config is not None:
        return config, "config"
    if config_params is not None:
        return config_params, "config_params"
    path = getattr(args, "deepspeed_config", None)
    if path is not None:
        return path, "args.deepspeed_config"
    return None, None


def _check_enabled_config(cfg: Mapping[str, Any], where: str) -> bool:
    """Stage 3 or a clear error; returns whether DeepCompile is on."""
    zero = cfg.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else None
    if stage != 3:
        raise ValueError(
            f"{where}: \"{BLOCK}\" is enabled but zero_optimization.stage is {stage!r}: "
            f"deepcompile_remat takes over ZeRO stage 3 only. Set \"zero_optimization\": "
            f"{{\"stage\": 3}}, or \"{BLOCK}\": {{\"enabled\": false}}.")
    compile_cfg = cfg.get("compile") or {}
    if not isinstance(compile_cfg, Mapping):
        return False
    return bool(compile_cfg.get("deepcompile", False))


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port=None, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, mesh_param=None, config_params=None):
    """Same signature and return as deepspeed.initialize."""
    import deepspeed

    kwargs = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                  training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                  dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                  mesh_param=mesh_param, config_params=config_params)
    if distributed_port is not None:  # else deepspeed's own default
        kwargs["distributed_port"] = distributed_port
    value, source = _config_of(args, config, config_params)
    if value is None:  # deepspeed's own error
        return deepspeed.initialize(**kwargs)
    cfg, where = load(value)
    block = parse_block(cfg.get(BLOCK), where=f"{where}: {BLOCK}")
    if not block.enabled:
        return deepspeed.initialize(**kwargs)

    deepcompile_on = _check_enabled_config(cfg, where)
    if deepcompile_on:
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"{where}: compile.deepcompile is true, but DeepCompile needs CUDA "
                             "and none is available; set it false to let deepcompile_remat "
                             "take over ZeRO-3 itself")
    # DeepSpeed accepts the unknown top-level block silently today; it is ours, not its.
    stripped = {k: v for k, v in cfg.items() if k != BLOCK}
    kwargs.update(config=stripped, config_params=None)
    if source == "args.deepspeed_config":
        kwargs["args"] = copy.copy(args)
        kwargs["args"].deepspeed_config = None
    result = deepspeed.initialize(**kwargs)
    engine = result[0]
    _attach(engine, block, deepcompile_on)
    return result


def _attach(engine, block: DeepSpeedBlock, deepcompile_on: bool) -> None:
    from deepcompile_remat.deepspeed import _ds_internals

    _ds_internals.warn_if_other_version()  # the stage was checked in the config it was built from
    if deepcompile_on:
        from deepcompile_remat.deepspeed import deepcompile

        deepcompile.install(engine, block)
        engine.compile(backend=block.backend)
        engine.dcr_takeover = None
        return
    from deepcompile_remat.deepspeed.takeover import take_over

    engine.dcr_takeover = take_over(engine, block)
