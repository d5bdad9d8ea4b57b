"""A ds_config whose "deepcompile_remat" block is enabled takes effect, or says so, even where
deepcompile_remat.deepspeed.install() was never called (issue 41, "never silently off").

The installed package puts deepcompile_remat_autoinstall.pth in site-packages; its import hook
wraps deepspeed.initialize as DeepSpeed is imported (deepcompile_remat/deepspeed/autoinstall.py).
Every test runs a fresh interpreter, as a user's would start: the hook is there only where the
.pth is, and only a new process shows what it does at start. The Trainer script is README.md's
train_trainer.py without its install() line, on 2 CPU ranks (torchrun, gloo), one step of a
1-layer Llama, with the shipped configs/trainer_zero3_remat_autocast.json.
"""
from __future__ import annotations

import os
import re
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "trainer_zero3_remat_autocast.json"
PTH = "deepcompile_remat_autoinstall.pth"
TAKEN_OVER = "takes the engine over, as install() would"
REFUSED = "DCR_AUTOINSTALL=0 turns the import hook off"

TRAINER_SCRIPT = textwrap.dedent('''
    import sys

    import deepspeed
    import torch
    import transformers

    import deepcompile_remat as dcr

    # No deepcompile_remat.deepspeed.install(): the block reaches DeepSpeed through Trainer.
    args = transformers.TrainingArguments(
        "trainer-out", deepspeed=sys.argv[1], max_steps=1, per_device_train_batch_size=1,
        save_strategy="no", report_to=[], use_cpu=True, torch_compile=True,
        torch_compile_backend="aot_eager")  # our eager kind: no C++ compiles on CPU
    deepspeed.init_distributed()
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    trainer = transformers.Trainer(model=model, args=args,
                                   train_dataset=[{"input_ids": r, "labels": r} for r in ids])
    trainer.train()
    print(f"rank {args.process_index}: {trainer.model_wrapped.dcr_takeover!r}", flush=True)
    if args.process_index == 0:
        print(dcr.reports()[0].summary(), flush=True)
''')


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "DCR_AUTOINSTALL"}
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "benchmarks"),
                                         env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _require_the_pth() -> None:
    """The hook exists only where the package was installed with it: a checkout installed
    before it shipped fails here, naming the fix, rather than in every test below."""
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    if not any((Path(d) / PTH).is_file() for d in dirs):
        pytest.fail(f"{PTH} is in none of {dirs}: reinstall the package "
                    "(pip install --no-build-isolation -e .)")


def _python(code: str, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          env=_env(**env), capture_output=True, text=True, timeout=timeout)


def _trainer(tmp_path, **env) -> subprocess.CompletedProcess:
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (scripts/install.sh)")
    pytest.importorskip("transformers", reason="transformers is not installed")
    _require_the_pth()
    script = tmp_path / "train_trainer.py"
    script.write_text(TRAINER_SCRIPT)
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script),
         str(CONFIG)], cwd=tmp_path, env=_env(**env), capture_output=True, text=True,
        timeout=900)


def test_the_hook_costs_nothing_at_start():
    """Silent cost guarded: a .pth runs in every Python process of the environment, so the hook
    must not import torch, DeepSpeed or even deepcompile_remat (~50 ms and a compiled
    extension) at start, and must not raise there; it only waits on sys.meta_path."""
    _require_the_pth()
    proc = _python('''
        import sys
        print(sorted(m for m in ("torch", "deepspeed", "deepcompile_remat", "numpy")
                     if m in sys.modules))
        print([type(f).__name__ for f in sys.meta_path].count("DeepSpeedImportHook"),
              "_deepcompile_remat_import_hook" in sys.modules)
    ''')
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["[]", "1 True"], proc.stdout


def test_the_wrapper_is_deepspeeds_initialize_for_install_and_refuses_a_misnamed_block():
    """Silent bugs guarded: install()/uninstall() dropping the hook's wrapper (the next engine
    silently stock again) or recursing through it; a misnamed block ("deepcompile-remat")
    reaching stock DeepSpeed, which ignores unknown keys. unwrap() gives DeepSpeed its own."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (scripts/install.sh)")
    _require_the_pth()
    proc = _python('''
        import sys
        import deepspeed
        import torch
        import deepcompile_remat.deepspeed as dcr_ds
        from deepcompile_remat.deepspeed import autoinstall, engine

        wrapper = deepspeed.initialize
        assert autoinstall.is_wrapper(wrapper), wrapper
        assert not dcr_ds.installed() and engine.stock_initialize() is wrapper
        dcr_ds.install(); dcr_ds.install()
        assert deepspeed.initialize is dcr_ds.initialize
        dcr_ds.uninstall(); dcr_ds.uninstall()
        assert deepspeed.initialize is wrapper and not dcr_ds.installed()
        for off in ("1", "0"):
            import os
            os.environ["DCR_AUTOINSTALL"] = off
            try:
                deepspeed.initialize(model=torch.nn.Linear(2, 2), dist_init_required=False,
                                     config={"zero_optimization": {"stage": 3},
                                             "deepcompile-remat": {"enabled": True}})
            except ValueError as e:
                assert "rename 'deepcompile-remat'" in str(e), e
            else:
                raise AssertionError("a misnamed block reached DeepSpeed")
        autoinstall.unwrap()
        assert deepspeed.initialize is wrapper.__wrapped__
        assert engine.stock_initialize() is wrapper.__wrapped__
        print("ok")
    ''', DS_ACCELERATOR="cpu")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_trainer_without_install_is_taken_over_and_says_so(tmp_path):
    """Before: a Trainer script whose ds_config had the block but that never called install()
    ran stock DeepSpeed ZeRO-3, the block silently ignored (no warning, no INFO line). Now
    the engine is taken over on both ranks, our partitioner cut the graph, and one WARNING
    (rank 0's) says so and how to turn it off."""
    proc = _trainer(tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    for rank in (0, 1):
        assert re.search(rf"^rank {rank}: Takeover\(", proc.stdout, re.M), proc.stdout[-3000:]
    assert re.search(r"^partition: \d+ nodes", proc.stdout, re.M), proc.stdout[-3000:]
    assert out.count(TAKEN_OVER) == 1, out[-5000:]
    assert "DCR_AUTOINSTALL=0" in out


def test_trainer_with_the_hook_off_refuses_the_block(tmp_path):
    """With DCR_AUTOINSTALL=0 the hook does not take over; the documented other behaviour is
    an error before any engine is built, naming the ways on (install(), "enabled": false),
    rather than a stock run with the block ignored."""
    proc = _trainer(tmp_path, DCR_AUTOINSTALL="0")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert REFUSED in out and "install()" in out and '"enabled": false' in out, out[-5000:]
    assert "Takeover(" not in out and TAKEN_OVER not in out
