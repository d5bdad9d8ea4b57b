"""README.md says what the code does: its programs run, its key table is RematConfig's, and the
two commands a new user starts from are there, verbatim.

The three programs of "Use it" are taken from README.md's fenced blocks (a block whose first line
is `# NAME.py; run: COMMAND`) and run with COMMAND, on CPU ranks over gloo, as a user would
paste them. The DeepSpeed and Trainer programs need DeepSpeed's CPU accelerator, which their
command sets (DS_ACCELERATOR=cpu)."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dcr_bench import config_keys

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PROGRAM = re.compile(r"^```python\n# (?P<name>\w+\.py); run: (?P<command>[^\n]+)\n(?P<body>.*?)^```",
                     re.M | re.S)


def _programs() -> dict:
    """name -> (launch command, source) of every runnable program in README.md."""
    return {m["name"]: (m["command"], f"# {m['name']}; run: {m['command']}\n{m['body']}")
            for m in PROGRAM.finditer(README.read_text())}


def _section(title: str) -> str:
    """The text of README.md's `## title` section, up to the next `## ` heading."""
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def test_readme_holds_the_three_programs():
    """Guards against a snippet losing its run line (the test below would then skip it
    silently): the three programs of the first screen are all found."""
    assert set(_programs()) == {"train_compile.py", "train_deepspeed.py", "train_trainer.py"}


@pytest.mark.parametrize("name", ["train_compile.py", "train_deepspeed.py", "train_trainer.py"])
def test_readme_program_runs(name, tmp_path):
    """Guards against README code that no longer runs (a renamed function, a changed config,
    a launch command that fails): each program runs with its own command on 2 CPU ranks and
    prints the partition report, i.e. our partitioner cut the graph (for DeepSpeed and the
    Trainer: the block was honoured, not ignored)."""
    pytest.importorskip("torch")
    if name != "train_compile.py":
        pytest.importorskip("deepspeed", reason="deepspeed is not installed (scripts/install.sh)")
    if name == "train_trainer.py":
        pytest.importorskip("transformers", reason="transformers is not installed")
    command, source = _programs()[name]
    (tmp_path / name).write_text(source)
    shutil.copytree(ROOT / "configs", tmp_path / "configs")  # "run from the repository root"
    words = shlex.split(command)
    env = dict(os.environ)
    while "=" in words[0]:  # VAR=value before the command
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    assert words[0] == "torchrun", command
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "benchmarks"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", *words[1:]],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert re.search(r"^partition: \d+ nodes", proc.stdout, re.M), proc.stdout[-3000:]


def test_config_key_table_is_current():
    """Guards against README's key table drifting from RematConfig (a field added, renamed,
    a default or docstring changed): the table between the markers is the generated one."""
    text = README.read_text()
    assert config_keys.BEGIN in text and config_keys.END in text
    assert config_keys.table_in(text) == config_keys.markdown_table(), (
        "README.md's key table is stale: run `deepcompile-remat config-keys --write README.md`")


def test_config_key_table_covers_every_field_with_its_json_default():
    """Guards against an undocumented key, or a default shown as Python writes it (True, None)
    rather than as the user writes it in the JSON block."""
    import dataclasses
    import json

    from deepcompile_remat.config import RematConfig

    rows = config_keys.markdown_table().splitlines()[2:]
    fields = dataclasses.fields(RematConfig)
    assert [r.split("|")[1].strip(" `") for r in rows] == [f.name for f in fields]
    for row, f in zip(rows, fields):
        key, takes, default, meaning = (c.strip() for c in row.strip("|").split(" | "))
        assert json.loads(default.strip("`")) == (
            list(f.default) if isinstance(f.default, tuple) else f.default), row
        assert "None" not in default and "True" not in default and "False" not in default
        assert len(meaning) > 20, f"{f.name}: no meaning in the table"
    enabled = next(r for r in rows if r.startswith("| `enabled`"))
    assert "| true or false | `true` |" in enabled
    bucket = next(r for r in rows if r.startswith("| `bucket_bytes`"))
    assert "| \"auto\" or integer >= 0 | `\"auto\"` |" in bucket


def test_field_without_docstring_is_refused(monkeypatch):
    """Guards against a key added to RematConfig without a docstring: the generator refuses to
    make a table that would leave it unexplained."""
    import inspect

    source = inspect.getsource(config_keys.config_module)
    undocumented = re.sub(r'(    cse: bool = True\n)    """[^"]*"""\n', r"\1", source)
    assert undocumented != source
    monkeypatch.setattr(config_keys.inspect, "getsource", lambda _module: undocumented)
    with pytest.raises(ValueError, match=r"without a docstring: \['cse'\]"):
        config_keys.field_docstrings()


def test_write_replaces_only_the_table(tmp_path):
    """Guards against `config-keys --write` damaging the README around the table, or writing
    into a file without markers."""
    doc = tmp_path / "README.md"
    doc.write_text(f"before\n{config_keys.BEGIN}\nold table\n{config_keys.END}\nafter\n")
    from dcr_bench import cli

    assert cli.main(["config-keys", "--write", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("\nafter\n")
    assert config_keys.table_in(text) == config_keys.markdown_table()
    bare = tmp_path / "bare.md"
    bare.write_text("no markers\n")
    with pytest.raises(SystemExit, match="bare.md: no config-keys markers"):
        cli.main(["config-keys", "--write", str(bare)])


def test_readme_keeps_the_two_commands_of_a_new_user():
    """Guards against the contract with a new user breaking: the main job's command and the
    test command stand verbatim in their own sections, and CI runs exactly that test command."""
    assert "```bash\nbash scripts/install.sh && deepcompile-remat profile\n```" in _section(
        "Set up and run the main job")
    assert "```bash\nbash scripts/test.sh\n```" in _section("Run all tests")
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
    assert ci[-1] == "bash scripts/test.sh", ci


def test_readme_links_resolve():
    """Guards against links into the tree that a move (benchmarks/dcr_bench, results/) left
    dangling, in README.md and benchmarks/README.md."""
    broken = []
    for doc in (README, ROOT / "benchmarks" / "README.md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken
