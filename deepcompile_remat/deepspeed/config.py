"""The "deepcompile_remat" block of a DeepSpeed JSON config.

    {"zero_optimization": {"stage": 3, ...}, "bf16": {"enabled": true},
     "deepcompile_remat": {"enabled": true, "backend": "inductor", "policy": "conservative"}}

Its keys are the RematConfig fields plus "backend" (the torch.compile backend the DeepSpeed
takeover compiles the module with: "inductor" or "eager"). Absent block or "enabled": false ->
the product is off: RematConfig(enabled=False), and initialize() is plain deepspeed.initialize.
Every key is validated, even in a disabled block, and an unknown one is an error that names it,
the file and the valid keys, so a typo never silently changes behaviour.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping, Union

from deepcompile_remat.config import RematConfig

BLOCK = "deepcompile_remat"
DEFAULT_BACKEND = "inductor"
# Keys of the block that are not RematConfig fields.
_EXTRA_KEYS = ("backend",)


@dataclass(frozen=True)
class DeepSpeedBlock:
    remat: RematConfig
    backend: str = DEFAULT_BACKEND

    @property
    def enabled(self) -> bool:
        return self.remat.enabled


def valid_keys() -> list:
    return sorted({f.name for f in dataclasses.fields(RematConfig)} | set(_EXTRA_KEYS))


def load(ds_config: Union[str, os.PathLike, Mapping[str, Any]]) -> tuple:
    """(the config as a dict, where it came from: its path, or "DeepSpeed config")."""
    if isinstance(ds_config, Mapping):
        return ds_config, "DeepSpeed config"
    where = str(ds_config)
    with open(ds_config) as f:
        try:
            return json.load(f), where
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from None


def block_from_deepspeed(ds_config: Union[str, os.PathLike, Mapping[str, Any]]) -> DeepSpeedBlock:
    """The whole block: the RematConfig and the backend kind."""
    ds_config, where = load(ds_config)
    return parse_block(ds_config.get(BLOCK), where=f"{where}: {BLOCK}")


def parse_block(block: Any, *, where: str = BLOCK) -> DeepSpeedBlock:
    if block is None:
        return DeepSpeedBlock(RematConfig.disabled())
    if not isinstance(block, Mapping):
        raise ValueError(f"{where} must be a JSON object, got {type(block).__name__}")
    known = valid_keys()
    for key in block:
        if key not in known:
            raise ValueError(f"{where}: unknown key {key!r}; valid keys: {known}")
    from deepcompile_remat.backends import KINDS  # torch-dependent: loaded when a block is read

    backend = block.get("backend", DEFAULT_BACKEND)
    if backend not in KINDS:
        raise ValueError(f"{where}: backend must be one of {list(KINDS)}, got {backend!r}")
    remat = RematConfig.from_dict({k: v for k, v in block.items() if k not in _EXTRA_KEYS},
                                  where=where)
    return DeepSpeedBlock(remat, backend)


def config_from_deepspeed(ds_config: Union[str, os.PathLike, Mapping[str, Any]]) -> RematConfig:
    """The block's RematConfig, for torch.compile(model, backend=backend(kind, config)).
    Validated whole (the "backend" key included) even when disabled: a typo must not wait for
    the day it is switched on."""
    return block_from_deepspeed(ds_config).remat
