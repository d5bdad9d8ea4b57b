"""transformers.Trainer (through Accelerate) with a DeepSpeed ZeRO-3 config holding the
"deepcompile_remat" block, on 2 CPU ranks: deepcompile_remat.deepspeed.install() makes the
deepspeed.initialize that Accelerate calls honour the block.

The models are built the way HF builds ZeRO-3 models: TrainingArguments(deepspeed=...) first
(its HfDeepSpeedConfig makes from_config construct under deepspeed.zero.Init), then the model.
The stock run and ours are built the same way, one after the other, each Trainer dropped before
the next model is built (a live HfDeepSpeedConfig changes how a model is constructed).
"""
import gc
import logging
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("deepspeed", reason="deepspeed is not installed (scripts/install.sh)")
pytest.importorskip("transformers", reason="transformers is not installed (scripts/install.sh)")

import deepcompile_remat as dcr  # noqa: E402
from dist_utils import run_ranks  # noqa: E402

STEPS, MICRO_BATCH, SEQ, VOCAB = 3, 2, 16, 128


def _dataset():
    rows = []
    for i in range(16):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def _ds_config(precision, on, backend):
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
           "steps_per_print": 10 ** 6,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_gather_16bit_weights_on_model_save": True}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": "auto"}  # Trainer's bf16=True fills it in
    else:
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    block = {"enabled": on}
    if backend is not None:
        block["backend"] = backend
    cfg["deepcompile_remat"] = block
    return cfg


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append((record.levelno, record.getMessage()))


def _train(rank, out_dir, precision, on, backend=None, compile_backend=None,
           checkpointing=False):
    import transformers

    from dcr_bench.harness import models
    from ds_utils import assert_deepspeed_never_gathered, full_fp32_params

    torch._dynamo.reset()
    dcr.clear_reports()
    args = transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=MICRO_BATCH, max_steps=STEPS,
        deepspeed=_ds_config(precision, on, backend), report_to=[], logging_steps=1,
        save_strategy="no", learning_rate=1e-2, use_cpu=True, bf16=precision == "bf16",
        dataloader_num_workers=0, seed=0, torch_compile=compile_backend is not None,
        torch_compile_backend=compile_backend, activation_checkpointing=checkpointing)
    torch.manual_seed(0)
    model = models.build_hf("llama", vocab=VOCAB, layers=2, hidden=64, dropout=0.0)
    assert hasattr(next(model.parameters()), "ds_id"), "HF did not build under zero.Init"
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_dataset())
    trainer.train()
    engine = trainer.model_wrapped
    result = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
              "takeover": getattr(engine, "dcr_takeover", None), "reports": dcr.reports(),
              "grad_acc_hooks": len(engine.optimizer._grad_acc_hooks),
              "checkpointing": model.is_activation_checkpointing}
    if on:
        # DeepSpeed's gather hooks gone: no parameter was ever gathered by DeepSpeed
        # (save_model below gathers on purpose, through DeepSpeed's own GatheredParameters).
        assert_deepspeed_never_gathered(engine)
    trainer.save_model(out_dir)
    result["params"] = full_fp32_params(engine)
    del trainer, args, model, engine
    gc.collect()  # the HfDeepSpeedConfig goes with its TrainingArguments
    return result


def _trainer_run(rank, world, precision, tmp, backend, compile_backend, checkpointing):
    from safetensors.torch import load_file

    import deepcompile_remat.deepspeed as dcr_ds
    from ds_utils import rank_env

    rank_env(rank, world)
    stock = _train(rank, os.path.join(tmp, "stock"), precision, False,
                   checkpointing=checkpointing)
    assert stock["takeover"] is None and stock["reports"] == []

    records = _Records()
    logging.getLogger("deepcompile_remat").addHandler(records)
    dcr_ds.install()
    dcr_ds.install()  # idempotent
    try:
        ours = _train(rank, os.path.join(tmp, "ours"), precision, True, backend, compile_backend,
                      checkpointing)
    finally:
        dcr_ds.uninstall()
        logging.getLogger("deepcompile_remat").removeHandler(records)
    assert not dcr_ds.installed()

    # Taken over: our partitioner ran, DeepSpeed's gradient hooks are gone.
    assert ours["takeover"] is not None and ours["reports"], "the block was ignored"
    assert ours["grad_acc_hooks"] == 0
    # Trainer turned checkpointing on in both runs (its regions used to make ours raise).
    assert ours["checkpointing"] == stock["checkpointing"] == checkpointing
    # Measured: losses within 7e-4 (eager, autocast) of stock DeepSpeed.
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(stock["losses"]),
                               rtol=0, atol=3e-3)
    assert len(ours["losses"]) == STEPS
    # save_model wrote what the engine holds (gathered by DeepSpeed from the partitions that
    # our shards alias).
    saved = load_file(os.path.join(tmp, "ours", "model.safetensors"))
    for name, want in ours["params"].items():
        key = name if name in saved else name.replace("model.", "", 1)
        if name == "lm_head.weight" and key not in saved:
            continue  # tied to the embedding, saved once
        torch.testing.assert_close(saved[key].float(), want, rtol=0, atol=1e-2 if precision ==
                                   "bf16" else 0, msg=lambda m: f"{name}: {m}")

    # torch_compile: honoured where the block leaves "backend" unset, else a warning.
    kind = ours["takeover"].kind
    warnings = [m for level, m in records.messages if level >= logging.WARNING]
    if compile_backend is not None and backend is not None:
        assert kind == backend, kind
        assert any("not honoured" in m and backend in m for m in warnings), warnings
    elif compile_backend is not None:
        assert kind == ("eager" if compile_backend == "aot_eager" else compile_backend), kind
        assert not warnings, warnings


@pytest.mark.parametrize("precision,backend,compile_backend,checkpointing", [
    ("autocast", "eager", "inductor", False),  # Trainer asks inductor; the block says eager: warn
    ("bf16", None, "aot_eager", False),         # the block leaves it to Trainer: our eager kind
    ("autocast", "eager", None, True),          # Trainer's activation_checkpointing=True
])
def test_trainer_with_the_block_takes_over(tmp_path, precision, backend, compile_backend,
                                           checkpointing):
    """Before: Trainer (Accelerate) calls deepspeed.initialize itself, so the block was
    silently ignored and stock DeepSpeed ran; torch_compile=True was dropped with an INFO
    line; and activation checkpointing made our partitioner raise (SDPA's RNG tag against the
    region's recompute request). Silent bugs guarded: the block ignored, DeepSpeed still
    gathering, losses off stock, save_model writing stale or empty weights, a compile backend
    request dropped without a word."""
    run_ranks(_trainer_run, 2, precision, str(tmp_path), backend, compile_backend, checkpointing)


def test_install_is_idempotent_reversible_and_never_recurses(monkeypatch):
    """Silent bug guarded: `deepspeed.initialize = dcr_ds.initialize` (the old advice) made ours
    call itself through the patched name, forever. uninstall() puts back what install()
    replaced."""
    import deepspeed

    import deepcompile_remat.deepspeed as dcr_ds
    from deepcompile_remat.deepspeed import engine

    stock = engine.stock_initialize()
    calls = []

    def fake_stock(**kwargs):
        calls.append(kwargs)
        return ("engine", None, None, None)

    monkeypatch.setitem(engine._stock, "initialize", fake_stock)
    try:
        for patch in (dcr_ds.install,
                      lambda: setattr(deepspeed, "initialize", dcr_ds.initialize)):
            patch()
            patch()
            assert deepspeed.initialize is dcr_ds.initialize and dcr_ds.installed()
            calls.clear()
            out = deepspeed.initialize(model=torch.nn.Linear(2, 2), dist_init_required=False,
                                       config={"zero_optimization": {"stage": 3}})
            assert out[0] == "engine" and len(calls) == 1  # DeepSpeed's own, once
            dcr_ds.uninstall()
            dcr_ds.uninstall()
            # What install() replaced; DeepSpeed's own where ours was set by hand (no record).
            assert deepspeed.initialize is (stock if patch is dcr_ds.install else fake_stock)
            assert not dcr_ds.installed()
    finally:
        deepspeed.initialize = stock


def test_install_warns_about_callers_it_cannot_reach(monkeypatch, caplog):
    """Silent bug guarded: a `from deepspeed import initialize` made before install() (or
    another library's patch of deepspeed.initialize, which install() replaces) bypassed the
    block without a word."""
    import sys
    import types

    import deepspeed

    import deepcompile_remat.deepspeed as dcr_ds
    from deepcompile_remat.deepspeed import engine

    stock = engine.stock_initialize()
    early = types.ModuleType("user_train_script")
    early.initialize = stock  # `from deepspeed import initialize`, before install()
    monkeypatch.setitem(sys.modules, "user_train_script", early)
    try:
        with caplog.at_level(logging.WARNING, logger="deepcompile_remat"):
            dcr_ds.install()
        assert dcr_ds.installed()
        held = [r.getMessage() for r in caplog.records if "user_train_script.initialize" in
                r.getMessage()]
        assert held and "bypass" in held[0], caplog.text
        dcr_ds.uninstall()
        del sys.modules["user_train_script"]
        caplog.clear()

        def other_patch(**kwargs):
            return stock(**kwargs)

        deepspeed.initialize = other_patch
        with caplog.at_level(logging.WARNING, logger="deepcompile_remat"):
            dcr_ds.install()
        assert any("other_patch" in r.getMessage() and "will not run" in r.getMessage()
                   for r in caplog.records), caplog.text
        dcr_ds.uninstall()
        assert deepspeed.initialize is other_patch  # uninstall() puts back what it replaced
        deepspeed.initialize = stock
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="deepcompile_remat"):
            dcr_ds.install()  # nothing held elsewhere: silent
        assert not caplog.records, caplog.text
    finally:
        dcr_ds.uninstall()
        deepspeed.initialize = stock


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "trainer.py")


def _example_code():
    """examples/trainer.py without its docstring: what the README shows as the script."""
    import ast

    with open(EXAMPLE) as f:
        source = f.read()
    body = ast.parse(source).body
    return "\n".join(source.splitlines()[body[1].lineno - 1:]).strip()


@pytest.mark.parametrize("config,flags", [
    ("trainer_zero3_remat.json", ["--bf16"]),
    ("trainer_zero3_remat_autocast.json", []),
])
def test_the_example_runs_with_the_shipped_trainer_configs(tmp_path, config, flags):
    """Before: the shipped configs, tried with Trainer as a new user would, clashed with
    Trainer's own arguments (a fixed micro-batch size and bf16) and save_model() wrote no
    weights (stage3_gather_16bit_weights_on_model_save false), so from_pretrained failed.
    The example runs as the README launches it (CPU: --use_cpu), and says that it ran: rank 0
    logs one takeover line, engine.dcr_takeover prints in one line."""
    import re
    import subprocess
    import sys

    import transformers
    from transformers.integrations import is_deepspeed_zero3_enabled

    out = tmp_path / "out"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(_free_port()), EXAMPLE,
           "--deepspeed", os.path.join(ROOT, "configs", config), *flags, "--output_dir",
           str(out), "--max_steps", "2", "--save_strategy", "no", "--use_cpu",
           # our eager backend (the config leaves "backend" to Trainer): no C++ build here
           "--torch_compile", "--torch_compile_backend", "aot_eager"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]

    took_over = re.findall(r"deepcompile_remat: took over (\d+) DeepSpeed ZeRO-3 parameters "
                           r"\(backend inductor; each repeated layer compiled on its own", output)
    assert len(took_over) == 1, output[-6000:]  # rank 0 only
    reprs = re.findall(r"rank \d: Takeover\(backend='eager', parameters=(\d+), "
                       r"released_bytes=(\d+), gathers_from_master=(?:True|False)\)", output)
    assert len(reprs) == 2 and {r[0] for r in reprs} == {took_over[0]}, output[-6000:]

    assert not is_deepspeed_zero3_enabled()  # a plain load, as a user's next script does
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert sum(p.numel() for p in model.parameters()) > 0
    assert all(p.abs().sum() > 0 for p in model.parameters())


def _free_port():
    from dcr_bench.harness.ranks import free_port

    return free_port()


def test_the_readme_shows_the_example_whole():
    """The README's Trainer snippet is examples/trainer.py itself (run by the test above), so
    it stays a script that runs."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert _example_code() in readme, "README.md's Trainer script differs from examples/trainer.py"
    assert "examples/trainer.py --deepspeed configs/trainer_zero3_remat.json" in readme
    assert "--use_cpu" in readme
