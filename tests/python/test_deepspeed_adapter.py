"""The DeepSpeed takeover's one adapter and its one reading of the config: DeepSpeed's
attributes checked before anything is built or patched, every patch recorded and undone by
engine.destroy() and uninstall(), and DeepSpeedSettings the only reader of the ds_config.
DeepSpeed engines run on 2 CPU ranks (gloo).
"""
import ast
import os
import pathlib

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

pytest.importorskip("deepspeed",
                    reason="deepspeed is not installed (scripts/install.sh installs it)")

from dcr_bench.harness.models import GPT  # noqa: E402
from deepcompile_remat.deepspeed.config import DeepSpeedSettings  # noqa: E402
from dist_utils import run_ranks  # noqa: E402
from ds_utils import ds_config, rank_env  # noqa: E402

DEEPSPEED_PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "deepcompile_remat" / "deepspeed"


def _engine(config):
    from deepcompile_remat.deepspeed import initialize

    torch.manual_seed(0)
    model = GPT(layers=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine, *_ = initialize(model=model, optimizer=opt, config=config)
    return engine


def _train(engine, rank, steps=2):
    losses = []
    for i in range(steps):
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * i + rank))
        loss = engine(ids).float().logsumexp(-1).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    return torch.stack(losses)


@pytest.fixture
def stock_must_not_run(monkeypatch):
    """DeepSpeed's own initialize replaced by one that fails the test: the check must come
    before DeepSpeed builds an engine."""
    from deepcompile_remat.deepspeed import engine

    def building(**_kwargs):
        raise AssertionError("DeepSpeed was asked to build the engine before the check")

    monkeypatch.setitem(engine._stock, "initialize", building)


# --- the start-up check ---------------------------------------------------------------------------

@pytest.mark.parametrize("module,owner,attribute,named", [
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_optimizer_step",
     "DeepSpeedZeroOptimizer_Stage3._optimizer_step"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3",
     "_prepare_fp32_grad_for_sub_group",
     "DeepSpeedZeroOptimizer_Stage3._prepare_fp32_grad_for_sub_group"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "destroy", "DeepSpeedEngine.destroy"),
    ("deepspeed.runtime.zero.partition_parameters", None, "ZeroParamStatus",
     "deepspeed.runtime.zero.partition_parameters.ZeroParamStatus"),
])
def test_a_deepspeed_without_an_attribute_the_takeover_uses_is_named_before_building(
        monkeypatch, stock_must_not_run, module, owner, attribute, named):
    """Before: another DeepSpeed only logged a warning, and a renamed private method failed
    (or, patched onto an object that no longer calls it, silently did nothing) in the middle
    of training. Now each attribute the takeover uses is looked up before DeepSpeed builds the
    engine, and a missing one is named with the version in hand and the version read."""
    import importlib

    import deepspeed

    from deepcompile_remat.deepspeed import initialize

    target = importlib.import_module(module)
    monkeypatch.delattr(getattr(target, owner) if owner else target, attribute)
    with pytest.raises(RuntimeError) as err:
        initialize(model=GPT(layers=1), config=ds_config("bf16", True), dist_init_required=False)
    assert str(err.value) == (
        f"DeepSpeed {deepspeed.__version__}: {named} is missing; the takeover was written for "
        "0.19.8 (deepcompile_remat/deepspeed/adapter.py lists what it uses)")


def test_the_check_is_the_takeovers_only(monkeypatch):
    """With the block off deepcompile_remat patches nothing, so it checks nothing: stock
    DeepSpeed is built whatever attributes it has."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from deepcompile_remat.deepspeed import engine, initialize

    monkeypatch.delattr(DeepSpeedZeroOptimizer_Stage3, "_optimizer_step")
    monkeypatch.setitem(engine._stock, "initialize", lambda **kw: ("stock",))
    assert initialize(model=GPT(layers=1), config=ds_config("bf16", False),
                      dist_init_required=False) == ("stock",)


def _instance_check(rank, world):
    rank_env(rank, world)
    from deepcompile_remat.deepspeed.takeover import take_over

    config = ds_config("bf16", False)
    engine = _engine(config)
    hooks = len(engine.optimizer._grad_acc_hooks)
    del engine.optimizer.micro_step_id  # set by DeepSpeed on the instance, read per gradient
    settings = DeepSpeedSettings.from_config({**config, "deepcompile_remat": {"enabled": True}},
                                             "test config")
    with pytest.raises(RuntimeError, match=r"DeepSpeed .*: DeepSpeedZeroOptimizer_Stage3."
                                           r"micro_step_id is missing; the takeover was written "
                                           r"for 0\.19\.8"):
        take_over(engine, settings)
    # Nothing was touched: DeepSpeed's hooks and methods are its own.
    assert len(engine.optimizer._grad_acc_hooks) == hooks > 0
    assert not {"step", "_optimizer_step", "destroy", "compile", "dcr_takeover"} & (
        set(vars(engine.optimizer)) | set(vars(engine)))


def test_a_missing_instance_attribute_is_named_before_the_first_patch():
    """The attributes DeepSpeed sets on the engine, its optimizer and its parameters can only
    be looked up once it is built: before the takeover's first patch, and a missing one leaves
    the engine untouched."""
    run_ranks(_instance_check, 2)


# --- undo --------------------------------------------------------------------------------------

def _originals(patches):
    """(owner, name, the owner's own value before, whether it had one) of each attribute
    patched: before its first patch (offload_states is patched twice, one wrapper on another)."""
    first: dict = {}
    for p in patches:
        first.setdefault((id(p.owner), p.name), (p.owner, p.name, p.original, p.had_own))
    return list(first.values())


def _assert_deepspeeds_own_again(originals):
    for owner, name, original, had_own in originals:
        if had_own:
            assert vars(owner)[name] is original, f"{type(owner).__name__}.{name}"
        else:
            assert name not in vars(owner), f"{type(owner).__name__}.{name} left behind"


def _undo(rank, world):
    rank_env(rank, world)
    import deepspeed
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    import deepcompile_remat.deepspeed as dcr_ds

    stock_initialize = deepspeed.initialize
    for end in ("destroy", "uninstall"):
        dcr_ds.install()
        engine = _engine(ds_config("bf16", True))
        takeover, optimizer = engine.dcr_takeover, engine.optimizer
        patched = {(type(p.owner).__name__, p.name) for p in takeover.adapter.patches}
        # What the step, the epilogue and DeepSpeed's 16-bit readers are replaced by, and the
        # engine's own methods: each recorded.
        assert {("DeepSpeedZeroOptimizer_Stage3", n) for n in (
            "step", "_optimizer_step", "_prepare_fp32_grad_for_sub_group",
            "unscale_and_clip_grads", "_reassign_or_swap_out_partitioned_parameters",
            "independent_gradient_partition_epilogue", "offload_states", "load_state_dict",
            "persistent_parameters")} <= patched, patched
        assert {("DeepSpeedEngine", n) for n in ("destroy", "compile", "dcr_takeover")} <= patched
        assert ("Parameter", "all_gather") in patched
        originals = _originals(takeover.adapter.patches)
        _train(engine, rank)
        module = engine.module
        if end == "destroy":
            engine.destroy()
        else:
            dcr_ds.uninstall()
            assert deepspeed.initialize is stock_initialize and not dcr_ds.installed()
        _assert_deepspeeds_own_again(originals)
        assert optimizer.step.__func__ is DeepSpeedZeroOptimizer_Stage3.step
        assert not hasattr(engine, "dcr_takeover") and takeover.ended
        # DeepSpeed's data back in its layout: 16-bit partitions, a flat gradient buffer.
        assert optimizer.lp_param_buffer.untyped_storage().nbytes() > 0
        assert all(p.ds_tensor.device.type != "meta" for p in module.parameters())
        assert optimizer.grad_partitions_flat_buffer.device.type != "meta"
        with pytest.raises(RuntimeError, match="takeover was ended"):
            module(torch.zeros(2, 16, dtype=torch.long))
        dcr_ds.uninstall()


def test_destroy_and_uninstall_undo_every_patch():
    """Before: DeepSpeed was patched from several files, irreversibly: a destroyed engine
    kept our methods, uninstall() only put deepspeed.initialize back. Now each patch is
    recorded by the engine's adapter, and engine.destroy() or uninstall() makes every
    patched attribute DeepSpeed's own again; the engine, which DeepSpeed's hooks left at
    takeover, refuses to train instead of training wrong."""
    run_ranks(_undo, 2)


def test_a_shared_patch_stays_while_another_takeover_needs_it():
    """torch's F.linear in place of DeepSpeed's zero3_linear_wrap is the whole process's:
    one engine's undo must not put DeepSpeed's back under another engine still taken over
    (its compiled forward would save gathered weights again)."""
    import types

    from deepcompile_remat.deepspeed.adapter import DeepSpeedAdapter

    module = types.ModuleType("functional")
    module.linear = deepspeeds = object()
    torchs = object()
    first, second = DeepSpeedAdapter("first"), DeepSpeedAdapter("second")
    first.share(module, "linear", torchs)
    module.linear = deepspeeds  # a later engine's zero.Init puts DeepSpeed's back
    second.share(module, "linear", torchs)
    assert module.linear is torchs
    first.undo()
    assert module.linear is torchs
    second.undo()
    assert module.linear is deepspeeds


# --- the settings: read once, the only reader --------------------------------------------------

_CONFIG_KEYS = {"zero_optimization", "bf16", "fp16", "torch_autocast", "compile", "stage",
                "offload_optimizer", "offload_param", "zero_hpz_partition_size",
                "mics_shard_size", "gradient_predivide_factor", "sequence_parallel_size",
                "deepcompile", "enabled", "cpu_offload", "cpu_offload_param", "device"}


def _reads_of_config_keys(path: pathlib.Path) -> list:
    """'file:line key' for each cfg["key"] or cfg.get("key") with a DeepSpeed config key."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key = node.slice.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Constant)):
            key = node.args[0].value
        if key in _CONFIG_KEYS:
            found.append(f"{path.name}:{node.lineno} {key}")
    return found


def test_only_the_settings_read_the_deepspeed_config():
    """Before: engine.py, config.py and takeover.py each read the ds_config, and they drifted
    (engine.py said hpZ was refused; config.py collected zero_hpz_partition_size and checked
    nothing). Now config.py's DeepSpeedSettings is the one reader."""
    found = [f for path in sorted(DEEPSPEED_PACKAGE.glob("*.py")) if path.name != "config.py"
             for f in _reads_of_config_keys(path)]
    assert not found, found
    assert _reads_of_config_keys(DEEPSPEED_PACKAGE / "config.py")  # the walk finds reads


def test_settings_hold_every_setting_the_takeover_depends_on():
    """Every DeepSpeed setting the takeover reads, by DeepSpeed's name, with DeepSpeed's
    defaults where absent; hpZ is taken over, not refused; the config DeepSpeed gets has no
    block."""
    cfg = ds_config("bf16", True, gradient_predivide_factor=2.0, compile={"deepcompile": False})
    cfg["zero_optimization"].update(zero_hpz_partition_size=2, cpu_offload=True)
    settings = DeepSpeedSettings.from_config(cfg, "ds.json")
    assert (settings.stage, settings.zero_hpz_partition_size, settings.offload_optimizer,
            settings.offload_param, settings.bf16, settings.deepcompile) == (
                3, 2, "cpu", None, True, False)
    assert settings.hpz and settings.takes_over and "deepcompile_remat" not in \
        settings.for_deepspeed
    # Optimizer offload to the host is taken over (test_deepspeed_offload.py), a partial one not.
    assert settings.unsupported() == ["gradient_predivide_factor 2.0 != 1.0 is not supported"]
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "ratio": 0.5}
    assert DeepSpeedSettings.from_config(cfg, "ds.json").unsupported()[0].startswith(
        "zero_optimization.offload_optimizer.ratio 0.5 != 1.0 (partial offload) is not supported")
    ranks = settings.for_ranks()
    assert ranks["zero_optimization.zero_hpz_partition_size"] == 2
    assert ranks["deepcompile_remat.enabled"] is True
    defaults = DeepSpeedSettings.from_config({}, "empty")
    assert (defaults.stage, defaults.zero_hpz_partition_size, defaults.mics_shard_size,
            defaults.remat.enabled, defaults.hpz) == (0, 1, -1, False, False)
    with pytest.raises(AttributeError):
        settings.stage = 2  # frozen: read once


def _hpz_over_the_whole_group(rank, world):
    rank_env(rank, world)
    from deepcompile_remat.deepspeed.takeover import check_supported
    from deepcompile_remat.zero3 import custom_ops

    cfg = ds_config("bf16", True, zero_optimization={
        "stage": 3, "stage3_param_persistence_threshold": 0, "zero_hpz_partition_size": 2})
    ours = _engine(cfg)
    settings = ours.dcr_takeover.settings
    assert settings.zero_hpz_partition_size == 2 and settings.where == "DeepSpeed config"
    params = list(ours.module.parameters())
    assert len(ours.dcr_takeover.hpz_params) == len(params)
    assert dist.get_world_size(params[0].ds_zero_param_process_group) == world
    # An hpZ group of every rank: the re-gathers are the primary gathers, no secondary group.
    group = params[0].ds_process_group or dist.group.WORLD
    assert custom_ops.secondary_group_of(group) is None
    losses = _train(ours, rank, 3)
    assert torch.isfinite(losses).all() and losses[-1] < losses[0], losses
    assert all(p.ds_secondary_tensor is None for p in params)
    # The settings are what the takeover honours: an engine with another hpZ than they say
    # is refused, naming both.
    without_hpz = DeepSpeedSettings.from_config(ds_config("bf16", True), "other.json")
    with pytest.raises(ValueError, match=r"the engine's zero_optimization.zero_hpz_partition_size "
                                         r"is 2, the config's 1 \(other.json\)"):
        check_supported(ours, without_hpz)
    ours.destroy()


def test_hpz_as_the_settings_say_over_the_whole_group():
    """zero_hpz_partition_size read from the settings, as DESIGN.md documents: taken over,
    not refused. hpZ of the whole data-parallel group (2 of 2 ranks) re-gathers as without
    hpZ (before: zero3.shard refused a secondary group as large as the shard group), and
    DeepSpeed's secondary partitions are dropped. (hpZ over 2 "nodes" of 2:
    test_deepspeed.py::test_hpz_is_taken_over_as_node_local_regathers.)"""
    run_ranks(_hpz_over_the_whole_group, 2)
