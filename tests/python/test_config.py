"""RematConfig: one validator for every field, the backend kind in the config, and the ways in
(code, the ds_config block, deepcompile_remat.backend). No torch.compile runs here: fast."""
import math

import pytest

import deepcompile_remat as dcr
from deepcompile_remat.config import DEFAULT_BACKEND, RematConfig, field_names


@pytest.mark.parametrize("field", ["enabled", "mark_parameter_aliases", "cast_before_gather",
                                   "schedule_gathers", "cse"])
@pytest.mark.parametrize("value", [1, 0, "true", None])
def test_bools_take_only_true_or_false(field, value):
    with pytest.raises(ValueError, match=rf"RematConfig.{field} must be true or false, "
                                         rf"got {value!r}"):
        RematConfig(**{field: value})


@pytest.mark.parametrize("field", ["max_prefetch", "bucket_bytes", "keep_reports"])
@pytest.mark.parametrize("value", [True, False, 1.5, "3", None])
def test_integers_refuse_bools_floats_and_strings(field, value):
    """keep_reports=True once passed as 1 (a bool is an int to isinstance). bucket_bytes also
    takes "auto", and says so."""
    takes = "one of \\['auto'\\] or an integer" if field == "bucket_bytes" else "an integer"
    with pytest.raises(ValueError, match=rf"RematConfig.{field} must be {takes}, "
                                         rf"got {value!r}"):
        RematConfig(**{field: value})


@pytest.mark.parametrize("field", ["max_prefetch", "bucket_bytes", "keep_reports"])
def test_integers_have_a_minimum(field):
    with pytest.raises(ValueError, match=rf"RematConfig.{field} must be >= 0, got -1"):
        RematConfig(**{field: -1})
    assert getattr(RematConfig(**{field: 0}), field) == 0


@pytest.mark.parametrize("value,why", [(math.nan, "must be a finite number, got nan"),
                                       (math.inf, "must be a finite number, got inf"),
                                       (-math.inf, "must be a finite number, got -inf"),
                                       (True, "must be a number, got True"),
                                       ("1e6", "must be a number, got '1e6'")])
def test_numbers_are_finite_and_not_bools(value, why):
    with pytest.raises(ValueError, match=rf"RematConfig.prefetch_budget_bytes {why}"):
        RematConfig(prefetch_budget_bytes=value)
    assert RematConfig(prefetch_budget_bytes=3).prefetch_budget_bytes == 3.0


@pytest.mark.parametrize("field,value", [("policy", "agressive"), ("policy", True),
                                         ("async_gathers", "yes"), ("async_gathers", None),
                                         ("backend", "aot_eager"), ("backend", False)])
def test_choices_take_only_their_literal_values(field, value):
    with pytest.raises(ValueError, match=rf"RematConfig.{field} must be one of \[.*\].*, "
                                         rf"got {value!r}"):
        RematConfig(**{field: value})


def test_parameter_indices_are_non_negative_integers():
    assert RematConfig(parameter_indices=[2, 0]).parameter_indices == (2, 0)
    assert RematConfig(parameter_indices=None).parameter_indices is None
    for value, where in (([0, -1], r"\[1\] must be a non-negative integer, got -1"),
                         ([True], r"\[0\] must be a non-negative integer, got True"),
                         ("01", r" must be a list of non-negative integers, got '01'"),
                         (3, r" must be a list of non-negative integers, got 3")):
        with pytest.raises(ValueError, match=rf"RematConfig.parameter_indices{where}"):
            RematConfig(parameter_indices=value)


def test_frozen_keyword_only_and_slotted():
    config = RematConfig()
    with pytest.raises(AttributeError):
        config.policy = "aggressive"  # frozen
    with pytest.raises(TypeError):
        RematConfig(False)  # keywords only
    assert not hasattr(config, "__dict__")  # slots: a misspelt attribute cannot be set


def test_from_dict_refuses_unknown_keys_and_names_them():
    with pytest.raises(ValueError, match=r"ds.json: unknown key 'polcy' \(did you mean 'policy'\?\); "
                                         r"valid keys: \[.*'backend'.*'policy'.*\]"):
        RematConfig.from_dict({"polcy": "aggressive"}, where="ds.json")
    with pytest.raises(ValueError, match=r"blk must be a JSON object, got list"):
        RematConfig.from_dict([], where="blk")
    with pytest.raises(ValueError, match=r"blk: RematConfig.keep_reports must be an integer, "
                                         r"got True"):
        RematConfig.from_dict({"keep_reports": True}, where="blk")


def test_backend_kind_lives_in_the_config():
    assert "backend" in field_names()
    assert RematConfig().backend is None and RematConfig().backend_kind == DEFAULT_BACKEND
    assert RematConfig(backend="eager").backend_kind == "eager"
    assert RematConfig.from_dict({"backend": "eager"}).backend == "eager"
    assert RematConfig(backend="eager").as_dict()["backend"] == "eager"  # ranks compare it


def test_backend_takes_its_kind_from_the_config():
    assert dcr.backend().__name__ == "deepcompile_remat_inductor"
    assert dcr.backend(config=RematConfig(backend="eager")).__name__ == "deepcompile_remat_eager"
    assert dcr.backend("eager", RematConfig(backend="eager")).__name__ == \
        "deepcompile_remat_eager"
    assert dcr.backend("eager", RematConfig()).__name__ == "deepcompile_remat_eager"
    with pytest.raises(ValueError, match=r"backend kind 'inductor' contradicts the config's "
                                         r"backend 'eager'"):
        dcr.backend("inductor", RematConfig(backend="eager"))
    with pytest.raises(ValueError, match=r"RematConfig.backend must be one of .*got 'eagr'"):
        dcr.backend("eagr")


def test_ds_config_block_parses_into_the_config():
    from deepcompile_remat.deepspeed import config_from_deepspeed

    got = config_from_deepspeed({"deepcompile_remat": {"enabled": True, "backend": "eager",
                                                       "max_prefetch": 4}})
    assert got == RematConfig(backend="eager", max_prefetch=4)
    assert config_from_deepspeed({}) == RematConfig.disabled()
    with pytest.raises(ValueError, match=r"DeepSpeed config: deepcompile_remat: RematConfig."
                                         r"backend must be one of \['eager', 'inductor'\] or "
                                         r"null, got 'tensorrt'"):
        config_from_deepspeed({"deepcompile_remat": {"backend": "tensorrt"}})


def test_make_partition_fn_is_off_when_disabled():
    """One public make_partition_fn: disabled gives torch's partitioner (the internal builder,
    partition.remat_partition_fn, always runs ours)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from deepcompile_remat import partition

    assert dcr.make_partition_fn(RematConfig.disabled()) is min_cut_rematerialization_partition
    assert not hasattr(partition, "make_partition_fn")
    with pytest.raises(TypeError, match="RematConfig"):
        dcr.make_partition_fn({"policy": "aggressive"})


@pytest.mark.parametrize("value,why", [(-0.5, "must be >= 0, got -0.5"),
                                       (math.nan, "must be a finite number, got nan"),
                                       (True, "must be a number, got True"),
                                       ("50%", "must be a number, got '50%'")])
def test_memory_budget_is_a_non_negative_number_or_null(value, why):
    """Budget mode: a fraction (<= 1) or bytes (> 1); also from the ds_config block."""
    from deepcompile_remat.deepspeed import config_from_deepspeed

    with pytest.raises(ValueError, match=rf"RematConfig.memory_budget {why}"):
        RematConfig(memory_budget=value)
    assert RematConfig().memory_budget is None
    got = config_from_deepspeed({"deepcompile_remat": {"memory_budget": 0.5}})
    assert got == RematConfig(memory_budget=0.5)
    assert config_from_deepspeed({"deepcompile_remat": {"memory_budget": 2 ** 30}}) \
        .memory_budget == 2.0 ** 30
