"""initialize(): deepspeed.initialize, with the "deepcompile_remat" block honoured.

    engine, optimizer, loader, scheduler = deepcompile_remat.deepspeed.initialize(
        model=model, optimizer=opt, config="configs/zero3_remat.json")
    loss = engine(batch); engine.backward(loss); engine.step(); engine.save_checkpoint(dir)

Block absent or disabled: deepspeed.initialize(...) with the arguments as given (a block
misnamed or misplaced, "deepcompile-remat" or nested in "zero_optimization", is an error either
way). Enabled: ZeRO stage 3 is required, and what the takeover does not implement (offload, hpZ,
MiCS, ...) is refused, both from the config before any engine is built; the block is removed
from the config DeepSpeed sees; then either
  - DeepCompile off: take_over() (takeover.py) puts the engine's parameters under our traced
    gathers and compiles the module with our backend, or
  - DeepCompile on (CUDA only): DeepCompile runs ZeRO-3 and we replace its partitioner
    (deepcompile.py); the engine is compiled with the block's backend.
The returned tuple is deepspeed.initialize's. engine.dcr_takeover says what happened: a
Takeover after take_over(), whose repr is one line (``Takeover(backend='inductor',
parameters=24, released_bytes=3221225472, gathers_from_master=True)``: the backend kind
compiling the module, the parameters taken over, the bytes of DeepSpeed's unused reduce buckets
released, whether the forward gathers from the fp32 master: "bf16"); None with
DeepCompile; absent on an engine built without the block. Rank 0 logs the same facts in one
INFO line of the "deepcompile_remat" logger at takeover.

Either way, with several ranks, every rank's block (defaults filled in) and the DeepSpeed
settings the takeover depends on are compared first: ranks that disagree would build
different engines and hang in their first mismatched collective, so they fail at once with a
message naming the key and the ranks.

Callers that call deepspeed.initialize themselves (transformers' Trainer, Accelerate): one line
before them, ``deepcompile_remat.deepspeed.install()``, makes deepspeed.initialize this
function for every caller; ``uninstall()`` puts DeepSpeed's back. Both are idempotent, and this
function always calls DeepSpeed's own initialize, never whatever deepspeed.initialize is now.
"""
from __future__ import annotations

import copy
import logging
import sys
from typing import Any, Callable, Mapping

from deepcompile_remat.config import RematConfig, check_ranks_agree
from deepcompile_remat.deepspeed.config import (BLOCK, load, parse_block, takeover_settings,
                                                unsupported_by_takeover)

log = logging.getLogger(__name__)
_stock: dict = {}  # "initialize": DeepSpeed's own deepspeed.initialize, once seen


def _remember_stock(fn) -> None:
    if fn is not None and not getattr(fn, "_dcr_initialize", False):
        _stock.setdefault("initialize", fn)


_remember_stock(getattr(sys.modules.get("deepspeed"), "initialize", None))


def stock_initialize() -> Callable:
    """DeepSpeed's own initialize, whatever deepspeed.initialize has been replaced with."""
    import deepspeed

    _remember_stock(deepspeed.initialize)
    if "initialize" not in _stock:
        raise RuntimeError(
            "deepcompile_remat: deepspeed.initialize was replaced by deepcompile_remat's "
            "initialize before DeepSpeed's own was seen, so it cannot be called. Use "
            "deepcompile_remat.deepspeed.install() to route every caller through ours.")
    return _stock["initialize"]


def install() -> None:
    """Makes deepspeed.initialize honour the "deepcompile_remat" block for every caller that
    looks it up when it calls (transformers' Trainer, Accelerate, `deepspeed.initialize(...)`
    in user code). Idempotent; uninstall() reverses it. A `from deepspeed import initialize`
    made before this keeps DeepSpeed's own: a warning names each module that holds it so, and
    another patch of deepspeed.initialize that this replaces."""
    import deepspeed

    stock = stock_initialize()
    _warn_if_bound_elsewhere(deepspeed.initialize, stock)
    deepspeed.initialize = initialize


def _qualified(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _holders_of(fn) -> list:
    """"module.name" for every module outside DeepSpeed (and outside us) holding `fn` under a
    name of its own: a `from deepspeed import initialize` made before install()."""
    found = []
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.split(".")[0] in ("deepspeed", "deepcompile_remat"):
            continue
        try:
            names = list(vars(module).items())
        except TypeError:
            continue
        found += [f"{module_name}.{name}" for name, value in names if value is fn]
    return sorted(found)


def _warn_if_bound_elsewhere(current, stock) -> None:
    """install() cannot reach a caller that holds DeepSpeed's initialize under its own name,
    and it replaces another patch of deepspeed.initialize (which then never runs): say so."""
    if current is not stock and not getattr(current, "_dcr_initialize", False):
        log.warning("deepcompile_remat.deepspeed.install(): deepspeed.initialize was %s, not "
                    "DeepSpeed's own (%s): it is replaced and will not run; deepcompile_remat "
                    "calls DeepSpeed's own", _qualified(current), _qualified(stock))
    holders = _holders_of(stock)
    if holders:
        log.warning("deepcompile_remat.deepspeed.install(): %s hold%s DeepSpeed's own "
                    "initialize (a `from deepspeed import initialize` made before install()); "
                    "calls through %s bypass the \"%s\" block. Call install() before that "
                    "import, or call deepspeed.initialize by its module.", ", ".join(holders),
                    "s" if len(holders) == 1 else "", "it" if len(holders) == 1 else "them",
                    BLOCK)


def uninstall() -> None:
    """Puts DeepSpeed's own deepspeed.initialize back (nothing to do if install() was not
    called)."""
    import deepspeed

    if getattr(deepspeed.initialize, "_dcr_initialize", False):
        deepspeed.initialize = stock_initialize()


def installed() -> bool:
    """True while install() is in effect (deepspeed.initialize is ours)."""
    import deepspeed

    return bool(getattr(deepspeed.initialize, "_dcr_initialize", False))


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


def _stage(cfg: Mapping[str, Any]):
    zero = cfg.get("zero_optimization") or {}
    return zero.get("stage", 0) if isinstance(zero, Mapping) else None


def _check_enabled_config(cfg: Mapping[str, Any], where: str) -> bool:
    """Stage 3 or a clear error; returns whether DeepCompile is on."""
    stage = _stage(cfg)
    if stage != 3:
        raise ValueError(
            f"{where}: \"{BLOCK}\" is enabled but zero_optimization.stage is {stage!r}: "
            f"deepcompile_remat takes over ZeRO stage 3 only. Set \"zero_optimization\": "
            f"{{\"stage\": 3}}, or \"{BLOCK}\": {{\"enabled\": false}}.")
    compile_cfg = cfg.get("compile") or {}
    if not isinstance(compile_cfg, Mapping):
        return False
    return bool(compile_cfg.get("deepcompile", False))


def _refuse_unsupported(cfg: Mapping[str, Any], where: str) -> None:
    """What the takeover does not implement, refused from the config itself: before DeepSpeed
    builds the engine (minutes on a large model), not after."""
    problems = unsupported_by_takeover(takeover_settings(cfg))
    if problems:
        raise ValueError(f"{where}: deepcompile_remat cannot take over this DeepSpeed engine: "
                         + "; ".join(problems) + f". Remove them, or set \"{BLOCK}\": "
                         "{\"enabled\": false} for stock DeepSpeed.")


def _enabled(section: Any) -> Any:
    return section.get("enabled") if isinstance(section, Mapping) else section


def effective_settings(cfg: Mapping[str, Any], remat: RematConfig) -> dict:
    """What every rank must agree on: the block's RematConfig, every field with its default
    (backend included), and the DeepSpeed settings that decide what the takeover does (stage,
    precision, DeepCompile)."""
    compile_cfg = cfg.get("compile")
    return {**{f"{BLOCK}.{k}": v for k, v in remat.as_dict().items()},
            "zero_optimization.stage": _stage(cfg),
            "bf16.enabled": _enabled(cfg.get("bf16")),
            "fp16.enabled": _enabled(cfg.get("fp16")),
            "torch_autocast": cfg.get("torch_autocast"),
            "compile.deepcompile": (compile_cfg.get("deepcompile")
                                    if isinstance(compile_cfg, Mapping) else None)}


def _init_distributed(distributed_port, dist_init_required) -> None:
    """What deepspeed.initialize does first, done before it so ranks can compare configs."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    kwargs = {"dist_init_required": dist_init_required}
    if distributed_port is not None:
        kwargs["distributed_port"] = distributed_port
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               **kwargs)


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port=None, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, mesh_param=None, config_params=None):
    """Same signature and return as deepspeed.initialize."""
    stock = stock_initialize()
    kwargs = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                  training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                  dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                  mesh_param=mesh_param, config_params=config_params)
    if distributed_port is not None:  # else deepspeed's own default
        kwargs["distributed_port"] = distributed_port
    value, source = _config_of(args, config, config_params)
    if value is None:  # deepspeed's own error
        return stock(**kwargs)
    cfg, where = load(value)
    remat = parse_block(cfg, where)
    # This rank's own checks first: a rank that fails here exits, and the launcher ends the rest.
    deepcompile_on = remat.enabled and _check_enabled_config(cfg, where)
    if remat.enabled and not deepcompile_on:
        _refuse_unsupported(cfg, where)
    if deepcompile_on:
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"{where}: compile.deepcompile is true, but DeepCompile needs CUDA "
                             "and none is available; set it false to let deepcompile_remat "
                             "take over ZeRO-3 itself")
    # Then every rank's view of the config, before any rank builds an engine from it.
    if dist_init_required is not False:
        _init_distributed(distributed_port, dist_init_required)
    check_ranks_agree(effective_settings(cfg, remat), where)
    if not remat.enabled:
        return stock(**kwargs)

    # DeepSpeed accepts the unknown top-level block silently today; it is ours, not its.
    stripped = {k: v for k, v in cfg.items() if k != BLOCK}
    kwargs.update(config=stripped, config_params=None)
    if source == "args.deepspeed_config":
        kwargs["args"] = copy.copy(args)
        kwargs["args"].deepspeed_config = None
    result = stock(**kwargs)
    engine = result[0]
    _attach(engine, remat, deepcompile_on)
    return result


initialize._dcr_initialize = True  # how install()/stock_initialize() recognise ours


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _attach(engine, remat: RematConfig, deepcompile_on: bool) -> None:
    from deepcompile_remat.deepspeed import _ds_internals

    _ds_internals.warn_if_other_version()  # the stage was checked in the config it was built from
    if deepcompile_on:
        from deepcompile_remat.deepspeed import deepcompile

        deepcompile.install(engine, remat)
        engine.compile(backend=remat.backend_kind)
        engine.dcr_takeover = None
        if _rank() == 0:
            log.info("deepcompile_remat: DeepCompile runs ZeRO-3; deepcompile_remat's "
                     "partitioner replaces DeepCompile's (backend %s)", remat.backend_kind)
        return
    from deepcompile_remat.deepspeed.takeover import take_over

    engine.dcr_takeover = take_over(engine, remat)

