"""What the DeepSpeed takeover does with each key of DeepSpeed's "zero_optimization" section
(the fields of deepspeed.runtime.zero.config.DeepSpeedZeroConfig, 0.19.8), so that none is
silently dropped. Each key is one of:

  honoured  means under the takeover what it means under stock ZeRO-3: DeepSpeed still does
            it (its optimizer step, checkpoints, zero.Init), or, for a ZeRO-1/2 key, ignores
            it as its ZeRO-3 does;
  replaced  tunes DeepSpeed's parameter gathers or gradient reduction, which the takeover
            replaces with its own; `by` says what does the job instead (a deepcompile_remat
            key where one tunes it). Set to other than DeepSpeed's default (and other than
            `quiet_for`, the values that ask for what the takeover does anyway), rank 0 names
            it in one warning (engine.py);
  refused   a value the takeover cannot honour (`by` says which) is refused before DeepSpeed
            builds the engine (config.DeepSpeedSettings.unsupported, check_enabled).

Keys are spelt as a config spells them: DeepSpeed's alias where the field has one
("stage3_prefetch_bucket_size"; DeepSpeed also accepts the field name, "prefetch_bucket_size").
tests/python/test_zero_config_fields.py checks that every field of DeepSpeed's model is here,
so a DeepSpeed that adds one fails it, naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass

HONOURED, REPLACED, REFUSED = "honoured", "replaced", "refused"


@dataclass(frozen=True)
class ZeroField:
    """How the takeover treats one "zero_optimization" key (module docstring)."""

    treatment: str
    """HONOURED, REPLACED or REFUSED."""
    by: str
    """Honoured: who honours it. Replaced: what does its job instead. Refused: which values."""
    quiet_for: tuple = ()
    """Replaced keys only: values that ask for what the takeover does anyway (not warned of)."""


def _honoured(by: str) -> ZeroField:
    return ZeroField(HONOURED, by)


def _replaced(by: str, quiet_for: tuple = ()) -> ZeroField:
    return ZeroField(REPLACED, by, quiet_for)


def _refused(which: str) -> ZeroField:
    return ZeroField(REFUSED, which)


_ZERO_1_2 = "ZeRO-1/2 only: DeepSpeed's ZeRO-3 ignores it, with or without the takeover"
_PER_USE = ("the takeover gathers every parameter where it is used, small gathers bucketed "
            "(deepcompile_remat.bucket_bytes), and keeps none gathered between steps")

ZERO_FIELDS: dict = {
    "stage": _refused("anything but 3: the takeover takes over ZeRO stage 3 only"),
    "contiguous_gradients": _replaced(
        "the compiled backward's reduce-scatters, bucketed by deepcompile_remat.bucket_bytes"),
    "reduce_scatter": _replaced(
        "the compiled backward's reduce-scatters (deepcompile_remat.async_reduce_scatters)"),
    "reduce_bucket_size": _replaced(
        "deepcompile_remat.bucket_bytes; DeepSpeed's reduce buckets are released"),
    "use_multi_rank_bucket_allreduce": _honoured(_ZERO_1_2),
    "allgather_partitions": _honoured(_ZERO_1_2),
    "allgather_bucket_size": _honoured(
        _ZERO_1_2 + " (ZeRO-3's gather size is stage3_prefetch_bucket_size)"),
    "overlap_comm": _replaced(
        "deepcompile_remat.async_gathers and async_reduce_scatters"),
    "compute_grad_norm": _honoured("DeepSpeed (it refuses false under ZeRO-3)"),
    "load_from_fp32_weights": _honoured("DeepSpeed's checkpoint loading"),
    "elastic_checkpoint": _honoured("DeepSpeed's checkpoints"),
    "offload_param": _refused("device \"nvme\"; \"cpu\" is honoured (the shards stay on "
                              "the host, each gather copies its shard to the accelerator "
                              "first)"),
    "offload_optimizer": _refused("device \"nvme\", a \"ratio\" below 1.0, \"super_offload\"; "
                                  "\"cpu\" is honoured (DeepSpeed steps the optimizer on the "
                                  "host, the takeover sends it each gradient)"),
    "zenflow": _refused("any: ZenFlow's selective updates hook DeepSpeed's gradient "
                        "partitioning, which the takeover bypasses"),
    "sub_group_size": _honoured("DeepSpeed's optimizer step"),
    "cpu_offload_param": _honoured("deprecated spelling of offload_param \"cpu\""),
    "cpu_offload_use_pin_memory": _honoured("deprecated: DeepSpeed ignores it"),
    "cpu_offload": _honoured("deprecated spelling of offload_optimizer \"cpu\""),
    "stage3_prefetch_bucket_size": _replaced(
        "deepcompile_remat.max_prefetch and prefetch_budget_bytes"),
    "stage3_param_persistence_threshold": _replaced(_PER_USE, quiet_for=(0,)),
    "stage3_model_persistence_threshold": _replaced(_PER_USE, quiet_for=(0,)),
    "stage3_max_live_parameters": _replaced(
        "the compiled graphs' gather schedule and cut (deepcompile_remat.prefetch_budget_bytes, "
        "memory_budget, peak_target)"),
    "stage3_max_reuse_distance": _replaced(
        "the cut decides which gathered weights the backward re-gathers "
        "(deepcompile_remat.mark_parameter_aliases, memory_budget, peak_target)"),
    "stage3_gather_16bit_weights_on_model_save": _honoured("DeepSpeed's save_16bit_model"),
    "stage3_module_granularity_threshold": _replaced(
        "deepcompile_remat.bucket_bytes (\"auto\": one gather per layer)"),
    "stage3_use_all_reduce_for_fetch_params": _replaced("the takeover's all-gathers"),
    "stage3_allgather_sequential": _replaced(
        "deepcompile_remat.bucket_bytes (0: one gather per parameter)"),
    "stage3_gather_fp16_weights_on_model_save": _honoured(
        "deprecated spelling of stage3_gather_16bit_weights_on_model_save"),
    "ignore_unused_parameters": _honoured(_ZERO_1_2),
    "legacy_stage1": _honoured(_ZERO_1_2),
    "round_robin_gradients": _honoured(_ZERO_1_2),
    "parameter_alignment": _honoured(_ZERO_1_2),
    "zero_hpz_partition_size": _honoured(
        "the takeover: the backward re-gathers within DeepSpeed's hpZ group"),
    "zero_quantized_weights": _refused("true (ZeRO++ qwZ)"),
    "zero_quantized_nontrainable_weights": _refused("true (ZeRO++)"),
    "zero_quantized_gradients": _refused("true (ZeRO++ qgZ)"),
    "memory_efficient_linear": _replaced(
        "the cut never saves a gathered weight for the backward "
        "(deepcompile_remat.mark_parameter_aliases); torch's F.linear is put back"),
    "pipeline_loading_checkpoint": _honoured("DeepSpeed's checkpoint loading"),
    "override_module_apply": _honoured("deepspeed.zero.Init, before the takeover"),
    "log_trace_cache_warnings": _replaced(
        "no trace cache: the compiled graphs' schedule orders the gathers"),
    "enable_sanity_checks": _replaced(
        "nothing: its checks are of DeepSpeed's reduce buckets and gathers"),
    "save_muon_momentum_buffer_in_memory": _honoured("DeepSpeed's optimizer step"),
    "leaf_module": _replaced(_PER_USE),
}


def keys_of(treatment: str) -> list:
    """The keys treated so (HONOURED, REPLACED or REFUSED), in the table's order."""
    return [key for key, entry in ZERO_FIELDS.items() if entry.treatment == treatment]


def replaced_warning(keys) -> str:
    """The one line rank 0 logs for the replaced `keys` a config sets (engine.py)."""
    named = "; ".join(f"{key} ({ZERO_FIELDS[key].by})" for key in keys)
    return ("deepcompile_remat: the takeover replaces DeepSpeed's ZeRO-3 parameter gathers and "
            "gradient reduction, so these zero_optimization settings have no effect (what does "
            f"their job instead in brackets): {named}")
