"""Never silently off: a ds_config whose "deepcompile_remat" block is enabled takes effect, or is
refused, even where deepcompile_remat.deepspeed.install() was never called.

The package ships deepcompile_remat_autoinstall.pth into site-packages (setup.py); at
interpreter start it loads _import_hook.py, which costs nothing until `deepspeed` is imported
and then calls wrap() here, once, before `import deepspeed` returns. wrap() replaces
deepspeed.initialize with a wrapper of DeepSpeed's own, so every caller gets the wrapper
(transformers' Trainer and Accelerate, `deepspeed.initialize(...)`, even a
`from deepspeed import initialize`). The wrapper reads the config of each call as our
initialize does (config.py: load, then parse_block) and:

  - no block, or "enabled": false: DeepSpeed's own initialize, called as it was called;
  - the block enabled: our initialize (engine.py), exactly what install() gives, and one
    WARNING per process (rank 0) saying so and how to turn it off;
  - the block enabled and DCR_AUTOINSTALL=0 (or false/no/off): a RuntimeError, before
    anything is built, naming the two ways on;
  - a block misnamed, misplaced or with a bad key: the error our initialize gives for it.

DCR_AUTOINSTALL=0 raises rather than warns because the variable turns off the patching, not
the block: a run whose config asks for the takeover and runs stock ZeRO-3 without it is the
silent bug this module removes, and one warning among N ranks' logs, followed by minutes of
engine building, is easily missed. Either way on is one line: install() (explicit, not
affected by the variable), or "enabled": false for stock DeepSpeed. The variable is read at
each call, so it can be set in the script itself.

The patch is made by a DeepSpeedAdapter (adapter.py) that outlasts uninstall(): the wrapper is
DeepSpeed's initialize as every caller and engine.stock_initialize() see it. install()
replaces it with ours and uninstall() puts it back; unwrap() puts DeepSpeed's own back. Ours,
which always strips an enabled block before calling the stock initialize, passes through the
wrapper untouched, so the two never recurse. Without the .pth (a plain checkout on
PYTHONPATH), nothing here runs: install() is then the only route.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os

from deepcompile_remat.deepspeed import engine
from deepcompile_remat.deepspeed.adapter import DeepSpeedAdapter
from deepcompile_remat.deepspeed.config import BLOCK, load, parse_block

log = logging.getLogger(__name__)

ENV = "DCR_AUTOINSTALL"
_OFF = ("0", "false", "no", "off")
_HOOK = DeepSpeedAdapter("the import hook (deepcompile_remat_autoinstall.pth)", lasting=True)
_warned: list = []  # the takeover's WARNING, once per process


def enabled() -> bool:
    """False where DCR_AUTOINSTALL is 0, false, no or off (any case): an enabled block is then
    refused instead of taken over."""
    return os.environ.get(ENV, "1").strip().lower() not in _OFF


def wrap(deepspeed_module) -> None:
    """deepspeed.initialize := the wrapper of DeepSpeed's own (module docstring), recorded by
    the hook's adapter; engine.stock_initialize() is the wrapper from now on. Idempotent."""
    current = deepspeed_module.initialize
    if is_wrapper(current) or getattr(current, "_dcr_initialize", False):
        return
    wrapper = _wrapping(current)
    _HOOK.replace(deepspeed_module, "initialize", wrapper)
    engine.use_as_stock(wrapper)


def unwrap() -> None:
    """DeepSpeed's own initialize back in place of the wrapper, and the stock initialize of
    install() and uninstall() from now on. Call it with install() not in effect (else the
    wrapper stays where install() put ours, with adapter.py's warning)."""
    wrappers = [p.replacement for p in _HOOK.patches]
    _HOOK.undo()
    for wrapper in wrappers:
        engine.use_as_stock(wrapper.__wrapped__, instead_of=wrapper)


def is_wrapper(fn) -> bool:
    """Whether `fn` is the import hook's wrapper of deepspeed.initialize."""
    return bool(getattr(fn, "_dcr_import_hook", False))


def _wrapping(own):
    signature = inspect.signature(own)

    @functools.wraps(own)
    def initialize(*args, **kwargs):
        try:
            arguments = signature.bind(*args, **kwargs).arguments
        except TypeError:
            return own(*args, **kwargs)  # DeepSpeed's own error
        if not _block_enabled(arguments):
            return own(*args, **kwargs)
        if not enabled():
            raise RuntimeError(_refusal())
        _warn_once()
        return engine.initialize(**arguments)

    initialize._dcr_import_hook = True
    return initialize


def _block_enabled(arguments: dict) -> bool:
    """Whether the config this call carries has the block enabled. A config DeepSpeed cannot
    read is DeepSpeed's to refuse (False); a block misnamed, misplaced or with a bad key raises
    our initialize's error."""
    value, _ = engine.config_of(arguments.get("args"), arguments.get("config"),
                                arguments.get("config_params"))
    if value is None:
        return False
    try:
        ds_config, where = load(value)
    except (ValueError, OSError):
        return False
    return parse_block(ds_config, where).enabled


def _rank() -> int:
    """This process's rank: torch.distributed's once started, else the launcher's RANK."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _warn_once() -> None:
    if _warned or _rank() != 0:
        return
    _warned.append(True)
    log.warning("deepcompile_remat: deepspeed.initialize was called with the \"%s\" block "
                "enabled and deepcompile_remat.deepspeed.install() was not: deepcompile_remat "
                "takes the engine over, as install() would (the import hook of the installed "
                "package). Call install() before the Trainer to make it explicit; set %s=0 to "
                "turn the hook off (an enabled block is then an error), or \"%s\": "
                "{\"enabled\": false} for stock DeepSpeed.", BLOCK, ENV, BLOCK)


def _refusal() -> str:
    return (f"deepcompile_remat: the DeepSpeed config has the \"{BLOCK}\" block enabled, but "
            f"{ENV}={os.environ.get(ENV)} turns the import hook off and "
            "deepcompile_remat.deepspeed.install() was not called, so stock DeepSpeed would run "
            f"with the block ignored. Call deepcompile_remat.deepspeed.install() before the "
            f"Trainer (or deepspeed.initialize), set \"{BLOCK}\": {{\"enabled\": false}} for "
            f"stock DeepSpeed, or unset {ENV}.")
