"""initialize(): deepspeed.initialize, with the "deepcompile_remat" block honoured.

    engine, optimizer, loader, scheduler = deepcompile_remat.deepspeed.initialize(
        model=model, optimizer=opt, config="configs/zero3_remat.json")
    loss = engine(batch); engine.backward(loss); engine.step(); engine.save_checkpoint(dir)

The config is read once, into a DeepSpeedSettings (config.py): every DeepSpeed setting this
module and the takeover depend on. Block absent or disabled: deepspeed.initialize(...) with the
arguments as given (a block misnamed or misplaced, "deepcompile-remat" or nested in
"zero_optimization", is an error either way). Enabled: ZeRO stage 3 is required, what the
takeover does not implement (parameter or optimizer offload to NVMe, MiCS, ZeRO++'s
quantized weights and gradients, ZenFlow, a gradient predivide factor, sequence parallelism)
is refused, and every DeepSpeed class and module attribute the takeover uses must exist
(adapter.check_deepspeed: an error naming each missing one), all before any engine is built;
hpZ (zero_hpz_partition_size) is taken over as the runtime's node-local re-gathers. Every
other "zero_optimization" key is honoured or replaced (zero_fields.py): rank 0 names the
replaced ones the config sets (DeepSpeed's gather and reduce tuning, which the takeover's
own gathers and reduce-scatters make moot) in one warning, with what does their job instead.
The block is removed from the config DeepSpeed sees; then either
  - DeepCompile off: take_over() (takeover.py) puts the engine's parameters under our traced
    gathers and compiles the module with our backend, or
  - DeepCompile on (CUDA only): DeepCompile runs ZeRO-3 and we replace its partitioner
    (deepcompile.py); the engine is compiled with the block's backend.
The returned tuple is deepspeed.initialize's. engine.dcr_takeover says what happened: a
Takeover after take_over(), whose repr is one line (``Takeover(backend='inductor',
parameters=24, released_bytes=3221225472, gathers_from_master=True)``: the backend kind
compiling the module, the parameters taken over, the bytes of DeepSpeed's unused reduce buckets
released, whether the forward gathers from the fp32 master: "bf16"); None with
DeepCompile; absent on an engine built without the block (and once destroyed). Rank 0 logs
the same facts in one INFO line of the "deepcompile_remat" logger at takeover.

Every patch of DeepSpeed is made by one DeepSpeedAdapter per engine (adapter.py), which
records it; engine.destroy() and uninstall() undo them.

Either way, with several ranks, every rank's block (defaults filled in) and the DeepSpeed
settings the takeover depends on (DeepSpeedSettings.for_ranks) are compared first: ranks that
disagree would build different engines and hang in their first mismatched collective, so they
fail at once with a message naming the key and the ranks.

Callers that call deepspeed.initialize themselves (transformers' Trainer, Accelerate): one line
before them, ``deepcompile_remat.deepspeed.install()``, makes deepspeed.initialize this
function for every caller; ``uninstall()`` puts back what install() replaced and ends every
takeover still alive. Both are idempotent, and this function always calls DeepSpeed's own
initialize, never whatever deepspeed.initialize is now. Where the package is installed, its
import hook (autoinstall.py) has wrapped DeepSpeed's initialize as DeepSpeed was imported: a
call with the block enabled comes here without install() (with a warning), and to this module
the wrapper is DeepSpeed's own (use_as_stock), which install() replaces and uninstall() puts
back.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import sys
from typing import Callable

from deepcompile_remat.config import check_ranks_agree
from deepcompile_remat.deepspeed.adapter import (DeepSpeedAdapter, check_deepspeed,
                                                 put_back_unrecorded, undo_every_adapter)
from deepcompile_remat.deepspeed.config import BLOCK, DeepSpeedSettings, load
from deepcompile_remat.deepspeed.zero_fields import replaced_warning

log = logging.getLogger(__name__)
_stock: dict = {}  # "initialize": DeepSpeed's deepspeed.initialize (or the hook's wrapper of it)
_INSTALL = DeepSpeedAdapter("install()")  # its one patch: deepspeed.initialize


def _remember_stock(fn) -> None:
    if fn is not None and not getattr(fn, "_dcr_initialize", False):
        _stock.setdefault("initialize", fn)


_remember_stock(getattr(sys.modules.get("deepspeed"), "initialize", None))


def use_as_stock(fn, instead_of=None) -> None:
    """`fn` is DeepSpeed's initialize from now on: the one install() replaces, uninstall() puts
    back and ours calls. The import hook makes its wrapper of DeepSpeed's own (autoinstall.py)
    the stock one as DeepSpeed is imported; `instead_of`: only where the stock one is that."""
    if instead_of is None or _stock.get("initialize") is instead_of:
        _stock["initialize"] = fn


def stock_initialize() -> Callable:
    """DeepSpeed's own initialize (or the import hook's wrapper of it, which passes every call
    ours makes through unchanged), whatever deepspeed.initialize has been replaced with."""
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
    another patch of deepspeed.initialize that this replaces (uninstall() puts it back)."""
    import deepspeed

    stock = stock_initialize()
    if installed():
        return
    _warn_if_bound_elsewhere(deepspeed.initialize, stock)
    _INSTALL.replace(deepspeed, "initialize", initialize)


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
        # With the import hook, `stock` is its wrapper: such calls still reach the block.
        through_hook = getattr(stock, "_dcr_import_hook", False)
        log.warning("deepcompile_remat.deepspeed.install(): %s hold%s DeepSpeed's own "
                    "initialize (a `from deepspeed import initialize` made before install()); "
                    "calls through %s bypass %s. Call install() before that import, or call "
                    "deepspeed.initialize by its module.", ", ".join(holders),
                    "s" if len(holders) == 1 else "", "it" if len(holders) == 1 else "them",
                    "install() (the import hook's wrapper still takes an enabled block over, "
                    "with a warning)" if through_hook else f"the \"{BLOCK}\" block")


def uninstall() -> None:
    """Undoes every patch deepcompile_remat made to DeepSpeed but the import hook's wrapper
    (autoinstall.unwrap() removes that): deepspeed.initialize is what install() replaced
    (DeepSpeed's own, or the wrapper, where ours was set by hand), and every engine still
    taken over ends its takeover (Takeover.end: DeepSpeed's attributes its own again; such an
    engine cannot train any more). Nothing to do if nothing was patched."""
    import deepspeed

    undo_every_adapter()
    if installed():  # `deepspeed.initialize = dcr_ds.initialize`, by hand: no record
        put_back_unrecorded(deepspeed, "initialize", stock_initialize())


def installed() -> bool:
    """True while install() is in effect (deepspeed.initialize is ours)."""
    import deepspeed

    return bool(getattr(deepspeed.initialize, "_dcr_initialize", False))


def config_of(args, config, config_params):
    """The config deepspeed.initialize would read, as (value, which argument held it)."""
    if config is not None:
        return config, "config"
    if config_params is not None:
        return config_params, "config_params"
    path = getattr(args, "deepspeed_config", None)
    if path is not None:
        return path, "args.deepspeed_config"
    return None, None


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
    value, source = config_of(args, config, config_params)
    if value is None:  # deepspeed's own error
        return stock(**kwargs)
    settings = DeepSpeedSettings.from_config(*load(value))
    # This rank's own checks first: a rank that fails here exits, and the launcher ends the rest.
    _check_before_building(settings)
    # Then every rank's view of the config, before any rank builds an engine from it.
    if dist_init_required is not False:
        _init_distributed(distributed_port, dist_init_required)
    check_ranks_agree(settings.for_ranks(), settings.where)
    if not settings.remat.enabled:
        return stock(**kwargs)
    if settings.takes_over and settings.replaced_zero_keys and _rank() == 0:
        log.warning("%s", replaced_warning(settings.replaced_zero_keys))

    # DeepSpeed accepts the unknown top-level block silently today; it is ours, not its.
    kwargs.update(config=settings.deepspeed_config(), config_params=None)
    if source == "args.deepspeed_config":
        kwargs["args"] = copy.copy(args)
        kwargs["args"].deepspeed_config = None
    building = contextlib.nullcontext()
    if settings.takes_over:
        from deepcompile_remat.deepspeed._ds_internals import fp32_partitions_created_as_aliases

        building = fp32_partitions_created_as_aliases(DeepSpeedAdapter("the engine build"))
    with building:
        result = stock(**kwargs)
    _attach(result[0], settings)
    return result


def _check_before_building(settings: DeepSpeedSettings) -> None:
    """With the block enabled, before DeepSpeed builds the engine (minutes on a large model):
    the settings the takeover needs (stage 3, nothing it does not implement), CUDA under
    DeepCompile, and every DeepSpeed class and module attribute it will use."""
    if not settings.remat.enabled:
        return
    settings.check_enabled()
    if settings.deepcompile:
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"{settings.where}: compile.deepcompile is true, but DeepCompile "
                             "needs CUDA and none is available; set it false to let "
                             "deepcompile_remat take over ZeRO-3 itself")
    check_deepspeed(deepcompile=bool(settings.deepcompile))


initialize._dcr_initialize = True  # how install()/stock_initialize() recognise ours


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _attach(engine, settings: DeepSpeedSettings) -> None:
    if settings.deepcompile:
        from deepcompile_remat.deepspeed import deepcompile

        remat, adapter = settings.remat, DeepSpeedAdapter("DeepCompile's partitioner")
        deepcompile.install(engine, remat, adapter)
        adapter.undo_on_destroy(engine)
        engine.compile(backend=remat.backend_kind)
        adapter.add(engine, "dcr_takeover", None)
        if _rank() == 0:
            log.info("deepcompile_remat: DeepCompile runs ZeRO-3; deepcompile_remat's "
                     "partitioner replaces DeepCompile's (backend %s)", remat.backend_kind)
        return
    from deepcompile_remat.deepspeed.takeover import take_over

    take_over(engine, settings)
