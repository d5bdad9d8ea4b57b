"""The "deepcompile_remat" block of a DeepSpeed JSON config, and reading configs the way
DeepSpeed does.

    {"zero_optimization": {"stage": 3, ...}, "bf16": {"enabled": true},
     "deepcompile_remat": {"enabled": true, "backend": "inductor", "policy": "conservative"}}

Its keys are the RematConfig fields, "backend" among them (the torch.compile backend the
DeepSpeed takeover compiles the module with: "inductor" or "eager"; absent: "inductor", or what
engine.compile(backend=...) asks for); the block parses straight into RematConfig, whose one
validator checks every key. Absent block or "enabled": false -> the product is off:
RematConfig(enabled=False), and initialize() is plain deepspeed.initialize. Every key is
validated, even in a disabled block, and an unknown one is an error that names it, the file and
the valid keys, so a typo never silently changes behaviour.

load() reads a config as deepspeed.initialize does (deepspeed/runtime/tensor_parallel/
init_utils.py::load_ds_config in 0.19.8): a dict as it is; a path to an HJSON file (JSON plus
comments and trailing commas), duplicate keys refused; otherwise a base64 (urlsafe) string of
HJSON. A config DeepSpeed accepts is accepted here, and one it refuses is refused.
"""
from __future__ import annotations

import base64
import binascii
import collections
import difflib
import json
import os
import re
from typing import Any, Mapping, Union

from deepcompile_remat.config import RematConfig

BLOCK = "deepcompile_remat"


def _reject_duplicate_keys(pairs):
    counts = collections.Counter(k for k, _ in pairs)
    duplicated = sorted(k for k, n in counts.items() if n > 1)
    if duplicated:  # DeepSpeed's own message (runtime/config_utils.py)
        raise ValueError(f"Duplicate keys in DeepSpeed config: {duplicated}")
    return dict(pairs)


def _hjson():
    try:
        import hjson  # a DeepSpeed dependency: present wherever DeepSpeed is
    except ImportError:
        return None
    return hjson


def _parse_file(path: str) -> Any:
    hjson = _hjson()
    with open(path) as f:
        text = f.read()
    try:
        if hjson is not None:
            return hjson.loads(text, object_pairs_hook=_reject_duplicate_keys)
        return json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except ValueError as e:  # JSONDecodeError and hjson's HjsonDecodeError are ValueErrors
        raise ValueError(f"{path}: not a valid DeepSpeed config ({e})") from None


def _parse_base64(text: str) -> Any:
    try:
        decoded = base64.urlsafe_b64decode(text).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    hjson = _hjson()
    try:
        data = hjson.loads(decoded) if hjson is not None else json.loads(decoded)
    except ValueError:
        return None
    return data if isinstance(data, Mapping) else None  # else: most likely a mistyped path


def load(ds_config: Union[str, os.PathLike, Mapping[str, Any]]) -> tuple:
    """(the config as a dict, where it came from: its path, "base64 config" or "DeepSpeed
    config"); read by DeepSpeed's rules (module docstring). Errors name the file."""
    if isinstance(ds_config, Mapping):
        return ds_config, "DeepSpeed config"
    if not isinstance(ds_config, (str, os.PathLike)):
        raise ValueError(f"a DeepSpeed config is a dict, a path or a base64 string, got "
                         f"{type(ds_config).__name__}")
    where = os.fspath(ds_config)
    if os.path.exists(where):
        data = _parse_file(where)
    else:
        data = _parse_base64(where) if isinstance(ds_config, str) else None
        if data is None:
            raise ValueError(f"{where}: no such DeepSpeed config file (nor a base64 string of "
                             "a config object)")
        where = "base64 config"
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: a DeepSpeed config must be a JSON object, got "
                         f"{type(data).__name__}")
    return dict(data), where


def _normalised(key: str) -> str:
    return re.sub(r"[^a-z0-9]", "", key.lower())


def _looks_like_block(key: Any) -> bool:
    """A key spelt close to BLOCK ("deepcompile-remat", "DeepCompileRemat", "deepcompile_rmat";
    not "deepcompile", DeepSpeed's own key under "compile")."""
    return isinstance(key, str) and difflib.SequenceMatcher(
        None, _normalised(key), _normalised(BLOCK)).ratio() >= 0.85


def check_block_placement(ds_config: Mapping[str, Any], where: str) -> None:
    """The block under a near-miss name, or nested in a section ("zero_optimization",
    "compile", ...), would be ignored by everyone (DeepSpeed accepts unknown keys there):
    an error that names the right place."""
    for key in ds_config:
        if key != BLOCK and _looks_like_block(key):
            raise ValueError(f"{where}: top-level key {key!r} is not read: deepcompile_remat "
                             f"reads the block \"{BLOCK}\" (rename {key!r} to \"{BLOCK}\")")
    for section, inner in ds_config.items():
        if not isinstance(inner, Mapping):
            continue
        for key in inner:
            if _looks_like_block(key):
                raise ValueError(f"{where}: \"{section}.{key}\" is not read: the \"{BLOCK}\" "
                                 f"block goes at the top level of the DeepSpeed config, beside "
                                 f"\"{section}\", not inside it")


def parse_block(ds_config: Mapping[str, Any], where: str) -> RematConfig:
    """The RematConfig of ds_config's block (errors name `where`, the config's source, and
    the block); absent: the product off (RematConfig.disabled()). A block misnamed or
    misplaced is an error (check_block_placement)."""
    check_block_placement(ds_config, where)
    block = ds_config.get(BLOCK)
    if block is None:
        return RematConfig.disabled()
    return RematConfig.from_dict(block, where=f"{where}: {BLOCK}")


def config_from_deepspeed(ds_config: Union[str, os.PathLike, Mapping[str, Any]]) -> RematConfig:
    """The block's RematConfig, for torch.compile(model, backend=backend(config=config)).
    Validated whole even when disabled: a typo must not wait for the day it is switched on."""
    ds_config, where = load(ds_config)
    return parse_block(ds_config, where)


# --- what the takeover does not implement --------------------------------------------------------
# Settings by their DeepSpeed config names, read from the config (before DeepSpeed builds the
# engine: takeover_settings) or from the engine (takeover.check_supported); one list of problems.

def _section(cfg: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = cfg.get(key)
    return value if isinstance(value, Mapping) else {}


def _offload_device(zero: Mapping[str, Any], key: str, deprecated_flag: str) -> Any:
    device = _section(zero, key).get("device")
    if device is None and zero.get(deprecated_flag) is True:  # DeepSpeed's deprecated spelling
        device = "cpu"
    return device


def takeover_settings(cfg: Mapping[str, Any]) -> dict:
    """The settings unsupported_by_takeover() checks, as the DeepSpeed config sets them (absent:
    DeepSpeed's default)."""
    zero = _section(cfg, "zero_optimization")
    return {"zero_optimization.offload_optimizer": _offload_device(zero, "offload_optimizer",
                                                                   "cpu_offload"),
            "zero_optimization.offload_param": _offload_device(zero, "offload_param",
                                                               "cpu_offload_param"),
            "zero_optimization.zero_hpz_partition_size": zero.get("zero_hpz_partition_size", 1),
            "zero_optimization.mics_shard_size": zero.get("mics_shard_size", -1),
            "gradient_predivide_factor": cfg.get("gradient_predivide_factor", 1.0),
            "sequence_parallel_size": cfg.get("sequence_parallel_size", 1)}


def _more_than(value: Any, bound: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > bound


def unsupported_by_takeover(settings: Mapping[str, Any]) -> list:
    """What in `settings` (takeover_settings' keys) the takeover does not implement, one
    sentence each; [] when it can take over."""
    problems = []
    for key in ("zero_optimization.offload_optimizer", "zero_optimization.offload_param"):
        device = settings.get(key)
        if device is not None and str(getattr(device, "value", device)) != "none":
            problems.append(f"{key} (device {str(getattr(device, 'value', device))!r}) is not "
                            "supported: the takeover keeps parameters, gradients and optimizer "
                            "states where DeepSpeed's ZeRO-3 partitions them, on the accelerator")
    if _more_than(settings.get("zero_optimization.mics_shard_size"), 0):
        problems.append("zero_optimization.mics_shard_size > 0 (MiCS) is not supported")
    factor = settings.get("gradient_predivide_factor")
    if factor is not None and factor != 1.0:
        problems.append(f"gradient_predivide_factor {factor!r} != 1.0 is not supported")
    if _more_than(settings.get("sequence_parallel_size"), 1):
        problems.append("sequence parallelism (sequence_parallel_size > 1) is not supported")
    return problems
