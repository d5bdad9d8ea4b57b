"""The layers of DESIGN.md stay layers: one table says which part of deepcompile_remat may import
which, every import in every file is checked against it, and the table itself has no cycle.

A part is a top-level entry of the package: a subpackage (partition/, zero3/, ...), a module
(config.py, backends.py, ...), a native extension (_C, _cuda), or the package's own __init__
(PACKAGE_API: `import deepcompile_remat as dcr`, `from deepcompile_remat import RematConfig`).
The product is everything but the harness (harness/, bench/, profile/: measurement code) and
the command line (cli.py, __main__.py). Among the product, the partitioner knows nothing of
ZeRO-3 (the runtime plugs in through PartitionHook) and the ZeRO-3 runtime does not reach into
the partitioner; FX facts both need live in fx_values, and
fx_arrays is the one bridge from FX graphs to the arrays the C++ core reads. The harness sits on the product;
bench/ and profile/ share harness/ and never import each other.
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "deepcompile_remat"
PACKAGE_API = "deepcompile_remat"  # the package's __init__

# part -> the parts it may import (function-level imports included).
ALLOWED: dict[str, set[str]] = {
    # product
    "_C": set(),
    "_cuda": set(),
    "config": set(),
    "fx_values": set(),
    "fx_arrays": {"fx_values"},
    "mincut": {"_C"},
    "comm": {"_C", "_cuda"},
    "partition": {"_C", "config", "fx_arrays", "fx_values"},
    "zero3": {"_C", "comm", "config", "fx_arrays", "fx_values"},
    "backends": {"config", "partition", "zero3"},
    PACKAGE_API: {"_C", "config", "partition", "backends"},
    "deepspeed": {"backends", "config", "zero3"},
    # harness
    "harness": set(),
    "bench": {"backends", "config", "deepspeed", "fx_values", "harness", "mincut", "partition"},
    "profile": {PACKAGE_API, "_C", "backends", "config", "deepspeed", "fx_arrays", "fx_values", "harness",
                "partition", "zero3"},
    # command line
    "cli": {"bench", "profile"},
    "__main__": {"cli"},
}


NATIVE = {"_C", "_cuda"}  # extension modules: parts whether or not this checkout built them


def _parts_on_disk(root: Path = PACKAGE) -> set[str]:
    parts = {PACKAGE_API} | NATIVE
    for entry in root.iterdir():
        if entry.is_dir() and (entry / "__init__.py").is_file():
            parts.add(entry.name)
        elif entry.suffix == ".py" and entry.name != "__init__.py":
            parts.add(entry.stem)
        elif entry.suffix == ".so":
            parts.add(entry.name.split(".")[0])  # _C.cpython-311-x86_64-linux-gnu.so -> _C
    return parts


def _part_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    if rel == Path("__init__.py"):
        return PACKAGE_API
    return rel.parts[0].removesuffix(".py")


def _imported_parts(path: Path, parts: set[str], root: Path = PACKAGE):
    """(line, part, the import as written) for every import of deepcompile_remat in the file,
    wherever it stands (module level or inside a function); relative imports resolved."""
    package = [root.name, *path.relative_to(root).parent.parts]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _resolve(node.lineno, alias.name.split("."), [], parts)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = base + (node.module.split(".") if node.module else [])
            yield from _resolve(node.lineno, module, [a.name for a in node.names], parts)


def _resolve(line: int, module: list[str], names: list[str], parts: set[str]):
    if not module or module[0] != PACKAGE.name:
        return
    written = ".".join(module) + (f" import {', '.join(names)}" if names else "")
    if len(module) > 1:
        yield line, module[1], written
        return
    # `import deepcompile_remat` or `from deepcompile_remat import X`: X a part, or the API.
    for name in names or [None]:
        yield line, name if name in parts else PACKAGE_API, written


def test_every_import_follows_the_table():
    parts = _parts_on_disk()
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = _part_of(path)
        for line, imported, written in _imported_parts(path, parts):
            if imported != part and imported not in ALLOWED.get(part, set()):
                broken.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {part} imports "
                              f"{imported} ({written}); allowed: {sorted(ALLOWED.get(part, ()))}")
    assert not broken, "imports outside tests/python/test_layering.py's table:\n" + "\n".join(
        broken)


def test_the_table_has_no_cycle():
    done, on_path = set(), []

    def visit(part):
        if part in on_path:
            raise AssertionError("import cycle in the table: "
                                 + " -> ".join(on_path[on_path.index(part):] + [part]))
        if part in done:
            return
        on_path.append(part)
        for imported in sorted(ALLOWED.get(part, ())):
            visit(imported)
        on_path.pop()
        done.add(part)

    for part in sorted(ALLOWED):
        visit(part)


def test_every_part_on_disk_has_a_row():
    """A new subpackage or module must be placed in the table (and so in the layers)."""
    missing = sorted(_parts_on_disk() - set(ALLOWED))
    assert not missing, f"parts of deepcompile_remat without a row in ALLOWED: {missing}"
    unknown = sorted({p for allowed in ALLOWED.values() for p in allowed} - set(ALLOWED))
    assert not unknown, f"ALLOWED names parts that have no row: {unknown}"


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    """The walk is not fooled by an import inside a function or a relative one."""
    fake = tmp_path / "deepcompile_remat"
    (fake / "partition").mkdir(parents=True)
    (fake / "zero3").mkdir()
    for init in (fake, fake / "partition", fake / "zero3"):
        (init / "__init__.py").write_text("")
    source = fake / "partition" / "cut.py"
    source.write_text("def f():\n    from deepcompile_remat.zero3 import hooks\n"
                      "from ..zero3 import shard\nfrom . import extract\n"
                      "from deepcompile_remat import RematConfig, zero3\n")
    found = sorted((line, part) for line, part, _ in
                   _imported_parts(source, _parts_on_disk(fake), root=fake))
    assert found == [(2, "zero3"), (3, "zero3"), (4, "partition"), (5, PACKAGE_API), (5, "zero3")]
