"""The "deepcompile_remat" block of a DeepSpeed JSON config, reading configs the way DeepSpeed
does, and DeepSpeedSettings: the config read once into every DeepSpeed setting the takeover
depends on (engine.py and takeover.py read it, never the config).

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
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Union

from deepcompile_remat.config import RematConfig
from deepcompile_remat.deepspeed import zero_fields

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


# --- the DeepSpeed settings the takeover depends on ----------------------------------------------

def _key(name: str, default: Any) -> Any:
    """A DeepSpeedSettings field: `name` is the setting's DeepSpeed config name (what every
    message and the ranks' comparison call it), `default` DeepSpeed's default."""
    return field(default=default, metadata={"key": name})


def _section(cfg: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = cfg.get(key)
    return value if isinstance(value, Mapping) else {}


def _offload_device(zero: Mapping[str, Any], key: str, deprecated_flag: str) -> Any:
    device = _section(zero, key).get("device")
    if device is None and zero.get(deprecated_flag) is True:  # DeepSpeed's deprecated spelling
        device = "cpu"
    return device


def _stage(cfg: Mapping[str, Any]) -> Any:
    """zero_optimization.stage (0 when absent; None when "zero_optimization" is no section)."""
    zero = cfg.get("zero_optimization") or {}
    return zero.get("stage", 0) if isinstance(zero, Mapping) else None


def _enabled(section: Any) -> Any:
    return section.get("enabled") if isinstance(section, Mapping) else section


def _more_than(value: Any, bound: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > bound


def _device_name(device: Any) -> Any:
    """An offload device as the config spells it ("cpu", "nvme"; DeepSpeed's enum's value)."""
    return None if device is None else str(getattr(device, "value", device))


def _replaced_zero_keys(zero: Mapping[str, Any]) -> tuple:
    """The keys of the "zero_optimization" section `zero` that the takeover replaces
    (zero_fields: replaced) and that it sets to other than DeepSpeed's ZeRO-3 default or the
    entry's quiet_for, by their config names. Each value is read by DeepSpeed's own model (an
    alias or the field name, "auto" as DeepSpeed reads it); one DeepSpeed refuses is left for
    DeepSpeed to name."""
    replaced = zero_fields.keys_of(zero_fields.REPLACED)
    if not zero or not replaced:
        return ()
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    model = DeepSpeedZeroConfig.model_fields
    field_name = {f.alias or name: name for name, f in model.items()}  # config key -> field
    field_name.update({name: name for name in model})  # DeepSpeed takes field names too
    default = DeepSpeedZeroConfig(stage=3)
    found = []
    for given, value in zero.items():
        name = field_name.get(given)
        key = model[name].alias or name if name is not None else None
        if key not in replaced or value in zero_fields.ZERO_FIELDS[key].quiet_for:
            continue
        try:
            read = DeepSpeedZeroConfig(stage=3, **{given: value})
        except ValueError:  # pydantic's ValidationError: DeepSpeed names it as it builds
            continue
        if getattr(read, name) != getattr(default, name):
            found.append(key)
    return tuple(found)


@dataclass(frozen=True)
class DeepSpeedSettings:
    """Every setting of a DeepSpeed config that deepcompile_remat depends on, read once
    (from_config) before DeepSpeed builds the engine; engine.py and takeover.py read this,
    never the config. Each field but `where`, `remat` and `for_deepspeed` carries the value of
    one DeepSpeed setting (its metadata "key" is the setting's DeepSpeed name; absent: DeepSpeed's
    default). from_engine reads the same settings from a built engine, which may have them from
    elsewhere than the config (an mpu, DeepSpeed's defaults)."""

    where: str
    """Where the config came from (its path, "base64 config", "DeepSpeed config"); errors
    name it."""
    remat: RematConfig
    """The "deepcompile_remat" block (RematConfig.disabled() when absent)."""
    stage: Any = _key("zero_optimization.stage", 0)
    """The ZeRO stage; the takeover takes over stage 3 only."""
    offload_optimizer: Any = _key("zero_optimization.offload_optimizer", None)
    """The optimizer offload device ("cpu", "nvme"; "cpu_offload": true is "cpu"): "cpu" is
    taken over (the fp32 master, its gradients and the optimizer states on the host, stepped
    by DeepSpeed; takeover.py), "nvme" refused."""
    offload_optimizer_ratio: Any = _key("zero_optimization.offload_optimizer.ratio", 1.0)
    """The share of the optimizer offloaded (< 1.0: partial offload, some sub-groups stepped
    on the accelerator); refused."""
    super_offload: Any = _key("zero_optimization.offload_optimizer.super_offload", False)
    """DeepSpeed's SuperOffload (its own optimizer, stepped beside the backward); refused."""
    offload_param: Any = _key("zero_optimization.offload_param", None)
    """The parameter offload device ("cpu_offload_param": true is "cpu"): "cpu" is taken over,
    with or without offload_optimizer "cpu" (the shards stay on the host, each gather copies its
    shard to the accelerator first; takeover.py); "nvme" refused."""
    zero_hpz_partition_size: Any = _key("zero_optimization.zero_hpz_partition_size", 1)
    """ZeRO++'s hpZ: > 1 makes the backward re-gather within DeepSpeed's hpZ group of this many
    ranks, which the takeover maps onto the runtime's secondary group (takeover.py); taken over,
    not refused."""
    mics_shard_size: Any = _key("zero_optimization.mics_shard_size", -1)
    """MiCS (> 0); refused."""
    zero_quantized_weights: Any = _key("zero_optimization.zero_quantized_weights", False)
    """ZeRO++'s qwZ (quantized weight all-gathers); refused."""
    zero_quantized_nontrainable_weights: Any = _key(
        "zero_optimization.zero_quantized_nontrainable_weights", False)
    """ZeRO++'s non-trainable weights stored quantized; refused."""
    zero_quantized_gradients: Any = _key("zero_optimization.zero_quantized_gradients", False)
    """ZeRO++'s qgZ (quantized gradient all-to-all); refused."""
    zenflow: Any = _key("zero_optimization.zenflow", None)
    """The ZenFlow section as given (None: off); refused."""
    gradient_predivide_factor: Any = _key("gradient_predivide_factor", 1.0)
    """Anything but 1.0 refused: the takeover's reduce-scatter averages once."""
    sequence_parallel_size: Any = _key("sequence_parallel_size", 1)
    """Sequence parallelism (> 1); refused."""
    bf16: Any = _key("bf16.enabled", None)
    """DeepSpeed's bf16 mode (16-bit partitions from an fp32 master)."""
    fp16: Any = _key("fp16.enabled", None)
    """DeepSpeed's fp16 mode."""
    torch_autocast: Any = _key("torch_autocast", None)
    """The torch_autocast section as given (fp32 partitions, bf16 compute)."""
    deepcompile: Any = _key("compile.deepcompile", None)
    """DeepCompile on: it runs ZeRO-3 and our partitioner replaces its own (CUDA only)."""
    for_deepspeed: Mapping = field(default_factory=dict, repr=False, compare=False)
    """The config DeepSpeed is given: this one without the "deepcompile_remat" block."""
    replaced_zero_keys: tuple = ()
    """The "zero_optimization" keys the config sets to other than DeepSpeed's default whose
    job the takeover does itself (zero_fields: replaced), by their config names; engine.py
    names them in one warning."""

    @classmethod
    def from_config(cls, ds_config: Mapping[str, Any], where: str) -> "DeepSpeedSettings":
        """The settings of `ds_config` (a dict: load()'s), the block parsed and validated
        (parse_block); `where` is the config's source, which errors name."""
        zero = _section(ds_config, "zero_optimization")
        return cls(
            where=where, remat=parse_block(ds_config, where),
            stage=_stage(ds_config),
            offload_optimizer=_offload_device(zero, "offload_optimizer", "cpu_offload"),
            offload_optimizer_ratio=_section(zero, "offload_optimizer").get("ratio", 1.0),
            super_offload=_section(zero, "offload_optimizer").get("super_offload", False),
            offload_param=_offload_device(zero, "offload_param", "cpu_offload_param"),
            zero_hpz_partition_size=zero.get("zero_hpz_partition_size", 1),
            mics_shard_size=zero.get("mics_shard_size", -1),
            zero_quantized_weights=zero.get("zero_quantized_weights", False),
            zero_quantized_nontrainable_weights=zero.get(
                "zero_quantized_nontrainable_weights", False),
            zero_quantized_gradients=zero.get("zero_quantized_gradients", False),
            zenflow=zero.get("zenflow"),
            gradient_predivide_factor=ds_config.get("gradient_predivide_factor", 1.0),
            sequence_parallel_size=ds_config.get("sequence_parallel_size", 1),
            bf16=_enabled(ds_config.get("bf16")), fp16=_enabled(ds_config.get("fp16")),
            torch_autocast=ds_config.get("torch_autocast"),
            deepcompile=_section(ds_config, "compile").get("deepcompile"),
            for_deepspeed={k: v for k, v in ds_config.items() if k != BLOCK},
            replaced_zero_keys=_replaced_zero_keys(zero))

    @classmethod
    def from_engine(cls, engine, remat: RematConfig) -> "DeepSpeedSettings":
        """The settings the takeover refuses, as the built `engine` resolved them (DeepSpeed's
        public config getters); the rest keep their defaults."""
        offload_optimizer = engine.zero_offload_optimizer()
        return cls(
            where="the DeepSpeed engine", remat=remat, stage=engine.zero_optimization_stage(),
            offload_optimizer=_device_name(getattr(offload_optimizer, "device", None)),
            offload_optimizer_ratio=getattr(offload_optimizer, "ratio", 1.0),
            super_offload=getattr(offload_optimizer, "super_offload", False),
            offload_param=_device_name(getattr(engine.zero_offload_param(), "device", None)),
            zero_hpz_partition_size=engine.zero_hpz_partition_size(),
            zero_quantized_weights=engine.zero_quantized_weights(),
            zero_quantized_nontrainable_weights=engine.zero_quantized_nontrainable_weights(),
            zero_quantized_gradients=engine.zero_quantized_gradients(),
            zenflow=engine.zenflow_config(),
            gradient_predivide_factor=engine.gradient_predivide_factor(),
            sequence_parallel_size=getattr(engine, "sequence_parallel_size", 1))

    @property
    def takes_over(self) -> bool:
        """Whether deepcompile_remat takes the engine over itself: the block enabled and
        DeepCompile off (with DeepCompile on, DeepCompile runs ZeRO-3)."""
        return self.remat.enabled and not self.deepcompile

    def deepspeed_config(self) -> dict:
        """The config DeepSpeed builds the engine from: this one without the block and, when
        deepcompile_remat takes over, with "zero_optimization.contiguous_gradients" false:
        with it on DeepSpeed preallocates its gradient reduce buckets (reduce_bucket_size
        elements per gradient dtype: 2 GB fp32 plus 1 GB bf16 at its default) for the
        gradient hooks the takeover removes, only for the takeover to free them. Nothing else
        of DeepSpeed's ZeRO-3 reads it (zero_fields.py: replaced)."""
        config = dict(self.for_deepspeed)
        if self.takes_over:
            config["zero_optimization"] = {**_section(config, "zero_optimization"),
                                           "contiguous_gradients": False}
        return config

    @property
    def hpz(self) -> bool:
        """Whether hpZ is on (zero_hpz_partition_size > 1)."""
        return _more_than(self.zero_hpz_partition_size, 1)

    def unsupported(self) -> list:
        """What the takeover does not implement, one sentence each, by DeepSpeed's names;
        [] when it can take over. hpZ is taken over (zero_hpz_partition_size); zero_fields.py
        says what becomes of every "zero_optimization" key."""
        problems = []
        optimizer_device = _device_name(self.offload_optimizer)
        if optimizer_device not in (None, "none", "cpu"):
            problems.append(f"{self.key('offload_optimizer')} (device {optimizer_device!r}) is "
                            "not supported: the takeover offloads the optimizer to \"cpu\" "
                            "only (NVMe swapping is DeepSpeed's alone)")
        elif optimizer_device == "cpu" and self.offload_optimizer_ratio != 1.0:
            problems.append(f"{self.key('offload_optimizer_ratio')} "
                            f"{self.offload_optimizer_ratio!r} != 1.0 (partial offload) is not "
                            "supported: the takeover sends every gradient to the host")
        if optimizer_device == "cpu" and self.super_offload:
            problems.append(f"{self.key('super_offload')} is not supported: SuperOffload "
                            "steps its own optimizer beside DeepSpeed's gradient hooks, which "
                            "the takeover replaces")
        param_device = _device_name(self.offload_param)
        if param_device not in (None, "none", "cpu"):
            problems.append(f"{self.key('offload_param')} (device {param_device!r}) is not "
                            "supported: the takeover offloads parameters to \"cpu\" only "
                            "(NVMe swapping is DeepSpeed's alone)")
        if _more_than(self.mics_shard_size, 0):
            problems.append(f"{self.key('mics_shard_size')} > 0 (MiCS) is not supported")
        if self.zero_quantized_weights:
            problems.append(f"{self.key('zero_quantized_weights')} (ZeRO++ qwZ) is not "
                            "supported: the takeover's own gathers would replace DeepSpeed's "
                            "quantized ones")
        if self.zero_quantized_nontrainable_weights:
            problems.append(f"{self.key('zero_quantized_nontrainable_weights')} is not "
                            "supported: DeepSpeed stores the non-trainable weights' shards "
                            "quantized, which the takeover's gathers would read as weights")
        if self.zero_quantized_gradients:
            problems.append(f"{self.key('zero_quantized_gradients')} (ZeRO++ qgZ) is not "
                            "supported: the takeover's own reduce-scatters would replace "
                            "DeepSpeed's quantized gradient all-to-all")
        if self.zenflow is not None:
            problems.append(f"{self.key('zenflow')} (ZenFlow) is not supported: its selective "
                            "updates hook DeepSpeed's gradient partitioning, which the takeover "
                            "bypasses")
        if self.gradient_predivide_factor is not None and self.gradient_predivide_factor != 1.0:
            problems.append(f"gradient_predivide_factor {self.gradient_predivide_factor!r} != "
                            "1.0 is not supported")
        if _more_than(self.sequence_parallel_size, 1):
            problems.append("sequence parallelism (sequence_parallel_size > 1) is not supported")
        return problems

    def check_enabled(self) -> None:
        """With the block enabled: ZeRO stage 3, and (when deepcompile_remat takes over itself)
        nothing unsupported(); a ValueError naming the config and the settings otherwise.
        Called before DeepSpeed builds the engine (minutes on a large model), not after."""
        if not self.remat.enabled:
            return
        if self.stage != 3:
            raise ValueError(
                f"{self.where}: \"{BLOCK}\" is enabled but zero_optimization.stage is "
                f"{self.stage!r}: deepcompile_remat takes over ZeRO stage 3 only. Set "
                f"\"zero_optimization\": {{\"stage\": 3}}, or \"{BLOCK}\": {{\"enabled\": false}}.")
        problems = self.unsupported() if self.takes_over else []
        if problems:
            raise ValueError(f"{self.where}: deepcompile_remat cannot take over this DeepSpeed "
                             "engine: " + "; ".join(problems) + f". Remove them, or set "
                             f"\"{BLOCK}\": {{\"enabled\": false}} for stock DeepSpeed.")

    @classmethod
    def key(cls, name: str) -> str:
        """The DeepSpeed config name of field `name`."""
        return cls.__dataclass_fields__[name].metadata["key"]

    def for_ranks(self) -> dict:
        """What every rank must agree on, by DeepSpeed's names: the block (every field with
        its default, backend included) and each DeepSpeed setting above."""
        return {**{f"{BLOCK}.{k}": v for k, v in self.remat.as_dict().items()},
                **{f.metadata["key"]: getattr(self, f.name) for f in fields(self)
                   if "key" in f.metadata}}
