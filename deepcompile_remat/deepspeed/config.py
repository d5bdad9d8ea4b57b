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
import json
import os
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


def parse_block(ds_config: Mapping[str, Any], where: str) -> RematConfig:
    """The RematConfig of ds_config's block (errors name `where`, the config's source, and
    the block); absent: the product off (RematConfig.disabled())."""
    block = ds_config.get(BLOCK)
    if block is None:
        return RematConfig.disabled()
    return RematConfig.from_dict(block, where=f"{where}: {BLOCK}")


def config_from_deepspeed(ds_config: Union[str, os.PathLike, Mapping[str, Any]]) -> RematConfig:
    """The block's RematConfig, for torch.compile(model, backend=backend(config=config)).
    Validated whole even when disabled: a typo must not wait for the day it is switched on."""
    ds_config, where = load(ds_config)
    return parse_block(ds_config, where)
