"""No ZeRO key silently dropped: every field of DeepSpeed's ZeRO config model is honoured,
replaced or refused by the takeover (deepcompile_remat/deepspeed/zero_fields.py), each refused
one is refused before an engine is built, and a replaced one the config sets is named.

Single-process and engine-free: DeepSpeed's own initialize is replaced by one that raises
_Built, so a refusal must come before it, and a call that passes our checks stops there.
"""
import logging
import os
import re

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("deepspeed",
                    reason="deepspeed is not installed (scripts/install.sh installs it)")

from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # noqa: E402

from deepcompile_remat.deepspeed import engine, initialize  # noqa: E402
from deepcompile_remat.deepspeed.config import DeepSpeedSettings  # noqa: E402
from deepcompile_remat.deepspeed.zero_fields import (HONOURED, REFUSED, REPLACED,  # noqa: E402
                                                     ZERO_FIELDS, keys_of)

# A value each refused key is refused at, and the name its refusal gives it where that is not
# the key itself (a deprecated spelling is named by what DeepSpeed reads it as).
REFUSED_AT = {
    "stage": (2, "zero_optimization.stage"),
    "offload_param": ({"device": "nvme", "nvme_path": "/tmp"}, "zero_optimization.offload_param"),
    "offload_optimizer": ({"device": "nvme", "nvme_path": "/tmp"},
                          "zero_optimization.offload_optimizer"),
    "zenflow": ({"topk_ratio": 0.1}, "zero_optimization.zenflow"),
    "zero_quantized_weights": (True, "zero_optimization.zero_quantized_weights"),
    "zero_quantized_nontrainable_weights": (
        True, "zero_optimization.zero_quantized_nontrainable_weights"),
    "zero_quantized_gradients": (True, "zero_optimization.zero_quantized_gradients"),
}


def _config(**zero):
    return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, **zero}, "deepcompile_remat": {"enabled": True}}


def _config_keys() -> dict:
    """Each field of DeepSpeed's ZeRO model by the name a config gives it (its alias, if any)."""
    return {field.alias or name: name for name, field in DeepSpeedZeroConfig.model_fields.items()}


class _Built(Exception):
    """DeepSpeed's initialize was called: every check of ours had passed."""


@pytest.fixture
def stock_builds_nothing(monkeypatch):
    def building(**_kwargs):
        raise _Built

    monkeypatch.setitem(engine._stock, "initialize", building)


def test_every_field_of_deepspeeds_zero_config_is_classified():
    """A DeepSpeed that adds a ZeRO field fails here, naming it, until zero_fields.py says
    whether the takeover honours, replaces or refuses it; a field DeepSpeed dropped is named
    too. Every setting DeepSpeedSettings reads from "zero_optimization" is in the table."""
    keys = _config_keys()
    assert sorted(set(keys) - set(ZERO_FIELDS)) == [], "fields zero_fields.py does not classify"
    assert sorted(set(ZERO_FIELDS) - set(keys)) == [], "entries for no field of DeepSpeed's"
    for key, entry in ZERO_FIELDS.items():
        assert entry.treatment in (HONOURED, REPLACED, REFUSED) and entry.by, key
        assert not entry.quiet_for or entry.treatment == REPLACED, key
    # A setting inside a section (offload_optimizer.ratio) is classified with its section.
    read = {f.metadata["key"].split(".")[1] for f in DeepSpeedSettings.__dataclass_fields__
            .values() if f.metadata.get("key", "").startswith("zero_optimization.")}
    # mics_shard_size: MiCS, which DeepSpeed 0.19.8 removed (it refuses the key itself).
    assert read - {"mics_shard_size"} <= set(ZERO_FIELDS), read
    assert all(ZERO_FIELDS[key].treatment != REPLACED for key in read - {"mics_shard_size"})


def test_every_refused_field_has_a_case_here():
    """A field the table newly refuses needs a value below that shows the refusal."""
    assert set(keys_of(REFUSED)) == set(REFUSED_AT)


@pytest.mark.parametrize("key", sorted(REFUSED_AT))
def test_each_refused_field_is_refused_before_deepspeed_builds_the_engine(
        key, stock_builds_nothing):
    """Before: ZeRO++'s zero_quantized_weights / zero_quantized_gradients (and ZenFlow) were
    accepted, and the takeover's own gathers and reduce-scatters silently replaced the
    quantized ones asked for."""
    value, named = REFUSED_AT[key]
    cfg = _config(**{key: value})
    with pytest.raises(ValueError, match=r"DeepSpeed config: .*" + re.escape(named)) as err:
        initialize(model=torch.nn.Linear(2, 2), config=cfg, dist_init_required=False)
    assert "\"deepcompile_remat\": {\"enabled\": false}" in str(err.value)  # what to do


def test_the_quantized_flags_are_taken_over_when_off():
    """Refused when true only: false, DeepSpeed's default, takes over as before."""
    flags = {"zero_quantized_weights": False, "zero_quantized_nontrainable_weights": False,
             "zero_quantized_gradients": False, "zenflow": None}
    DeepSpeedSettings.from_config(_config(**flags), "ds.json").check_enabled()


def test_parameter_offload_alone_is_taken_over():
    """offload_param "cpu" (or its deprecated spelling) without offload_optimizer: refused until
    issue 42, taken over now (test_deepspeed_offload trains it against stock DeepSpeed)."""
    for zero in ({"offload_param": {"device": "cpu"}}, {"cpu_offload_param": True}):
        settings = DeepSpeedSettings.from_config(_config(**zero), "ds.json")
        settings.check_enabled()
        assert settings.offload_param == "cpu" and settings.offload_optimizer is None, zero


def _warnings_of(caplog, cfg) -> list:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deepcompile_remat"), pytest.raises(_Built):
        initialize(model=torch.nn.Linear(2, 2), config=cfg, dist_init_required=False)
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_replaced_fields_the_config_sets_are_named_in_one_warning(
        caplog, stock_builds_nothing):
    """Before: stage3_prefetch_bucket_size, reduce_bucket_size, overlap_comm... were accepted
    and did nothing under the takeover, silently. Now rank 0 names each one set in one line,
    with what does its job instead; honoured keys, defaults, "auto", a persistence threshold
    of 0 (what the takeover does anyway) and DeepSpeed's field-name spelling are read as
    DeepSpeed reads them."""
    cfg = _config(stage3_prefetch_bucket_size=1e6, reduce_bucket_size=5e8, overlap_comm=False,
                  stage3_param_persistence_threshold=0, stage3_max_live_parameters="auto",
                  sub_group_size=1e8, max_reuse_distance=10)
    warnings = _warnings_of(caplog, cfg)
    assert len(warnings) == 1, warnings
    line = warnings[0]
    assert "stage3_prefetch_bucket_size (deepcompile_remat.max_prefetch" in line, line
    assert "overlap_comm (deepcompile_remat.async_gathers" in line, line
    assert "stage3_max_reuse_distance" in line, line  # spelt by field name in the config
    for not_named in ("reduce_bucket_size", "stage3_param_persistence_threshold",
                      "stage3_max_live_parameters", "sub_group_size"):
        assert not_named not in line, (not_named, line)
    assert _warnings_of(caplog, _config(
        stage3_param_persistence_threshold=0, stage3_gather_16bit_weights_on_model_save=True)) \
        == []
