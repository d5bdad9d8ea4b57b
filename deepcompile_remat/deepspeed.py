"""The "deepcompile_remat" block of a DeepSpeed JSON config -> RematConfig.

    cfg = deepcompile_remat.deepspeed.config_from_deepspeed("configs/zero3_remat.json")
    if cfg is not None:
        model = torch.compile(model, backend=deepcompile_remat.backend("inductor", cfg))

Absent block or "enabled": false -> None (the product is off). Unknown keys are errors that
name the key and the file, so a typo never silently changes behaviour.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional, Union

from deepcompile_remat.config import RematConfig

BLOCK = "deepcompile_remat"


def config_from_deepspeed(ds_config: Union[str, os.PathLike, Mapping[str, Any]]) -> Optional[RematConfig]:
    where = "DeepSpeed config"
    if not isinstance(ds_config, Mapping):
        where = str(ds_config)
        with open(ds_config) as f:
            try:
                ds_config = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
    block = ds_config.get(BLOCK)
    if block is None:
        return None
    enabled = block.get("enabled", True) if isinstance(block, Mapping) else True
    if not isinstance(enabled, bool):
        raise ValueError(f"{where}: {BLOCK}.enabled must be true or false, got {enabled!r}")
    if not enabled:
        return None
    return RematConfig.from_dict(block, where=f"{where}: {BLOCK}")
