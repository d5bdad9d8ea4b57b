"""The layers of DESIGN.md stay layers: one table says which part of deepcompile_remat (the
product) and of dcr_bench (the measurement tools, benchmarks/dcr_bench) may import which, every
import in every file of both is checked against it, and the table itself has no cycle.

A part is a top-level entry of a package: a subpackage (partition/, zero3/, ...), a module
(config.py, backends.py, ...), a native extension (_C, _cuda), or the package's own __init__
(PACKAGE_API: `import deepcompile_remat as dcr`, `from deepcompile_remat import RematConfig`).
Among the product, the partition library knows nothing of ZeRO-3 and the ZeRO-3 runtime does
not reach into it: the planning layer (planning/) sits above both and runs them; FX facts both need
live in fx_values, and fx_arrays is the one bridge from FX graphs to the arrays the C++ core
reads. The product never imports the tools. Among the tools, harness/ sits on the product;
bench/ and profile/ share harness/ and never import each other.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "deepcompile_remat"
TOOLS = ROOT / "benchmarks" / "dcr_bench"
PACKAGE_API = "deepcompile_remat"  # the package's __init__
TOOLS_API = "dcr_bench"  # the tools package's __init__

# part -> the parts it may import (function-level imports included). Parts of both packages
# share one namespace: their names do not collide, and a tool names the product parts it reads.
ALLOWED: dict[str, set[str]] = {
    # product (deepcompile_remat/)
    "_C": set(),
    "_cuda": set(),
    "config": set(),
    "fx_values": set(),
    "fx_arrays": {"_C", "fx_values"},
    "mincut": {"_C"},
    "comm": {"_C", "_cuda"},
    "partition": {"_C", "config", "fx_arrays", "fx_values"},
    "zero3": {"_C", "comm", "config", "fx_arrays", "fx_values"},
    "planning": {"_C", "config", "fx_arrays", "fx_values", "partition", "zero3"},
    "backends": {"config", "partition", "planning", "zero3"},
    PACKAGE_API: {"_C", "config", "partition", "backends"},
    "deepspeed": {"backends", "config", "zero3"},
    # measurement tools (benchmarks/dcr_bench/)
    TOOLS_API: set(),
    "harness": set(),
    "bench": {"backends", "config", "deepspeed", "fx_values", "harness", "mincut", "partition",
              "planning"},
    "profile": {PACKAGE_API, "_C", "backends", "config", "deepspeed", "fx_arrays", "fx_values", "harness",
                "partition", "zero3"},
    # the block's key table, made from RematConfig's field docstrings (README.md's)
    "config_keys": {"config"},
    "traffic": {PACKAGE_API, "bench", "harness", "zero3"},
    # the deepcompile-remat command
    "cli": {"bench", "config_keys", "profile", "traffic"},
    "__main__": {"cli"},
}


NATIVE = {"_C", "_cuda"}  # extension modules: parts whether or not this checkout built them
PACKAGES = {PACKAGE_API: PACKAGE, TOOLS_API: TOOLS}  # import name -> folder


def _parts_on_disk(root: Path = PACKAGE) -> set[str]:
    parts = {root.name}
    if root.name == PACKAGE_API:
        parts |= NATIVE
    for entry in root.iterdir():
        if entry.is_dir() and (entry / "__init__.py").is_file():
            parts.add(entry.name)
        elif entry.suffix == ".py" and entry.name != "__init__.py":
            parts.add(entry.stem)
        elif entry.suffix == ".so":
            parts.add(entry.name.split(".")[0])  # _C.cpython-311-x86_64-linux-gnu.so -> _C
    return parts


def _all_parts() -> dict[str, set[str]]:
    """import name of each package -> its parts on disk."""
    return {name: _parts_on_disk(root) for name, root in PACKAGES.items()}


def _part_of(path: Path, root: Path = PACKAGE) -> str:
    rel = path.relative_to(root)
    if rel == Path("__init__.py"):
        return root.name
    return rel.parts[0].removesuffix(".py")


def _imported_parts(path: Path, parts: dict[str, set[str]], root: Path = PACKAGE):
    """(line, part, the import as written) for every import of either package in the file,
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


def _resolve(line: int, module: list[str], names: list[str], parts: dict[str, set[str]]):
    if not module or module[0] not in parts:
        return
    written = ".".join(module) + (f" import {', '.join(names)}" if names else "")
    if len(module) > 1:
        yield line, module[1], written
        return
    # `import deepcompile_remat` or `from deepcompile_remat import X`: X a part, or the API.
    for name in names or [None]:
        yield line, name if name in parts[module[0]] else module[0], written


def test_every_import_follows_the_table():
    parts = _all_parts()
    broken = []
    for root in PACKAGES.values():
        for path in sorted(root.rglob("*.py")):
            part = _part_of(path, root)
            for line, imported, written in _imported_parts(path, parts, root):
                if imported != part and imported not in ALLOWED.get(part, set()):
                    broken.append(
                        f"{path.relative_to(ROOT)}:{line}: {part} imports {imported} "
                        f"({written}); allowed: {sorted(ALLOWED.get(part, ()))}")
    assert not broken, "imports outside tests/python/test_layering.py's table:\n" + "\n".join(
        broken)


def test_the_product_never_imports_the_tools():
    """The product's rows name no tool part: a benchmark can change without the product (or a
    user's compile cache, which hashes the product's sources) noticing."""
    tools = _parts_on_disk(TOOLS) - _parts_on_disk(PACKAGE)
    product = _parts_on_disk(PACKAGE)
    leaks = {part: sorted(ALLOWED[part] & tools) for part in product if ALLOWED.get(part, set()) & tools}
    assert not leaks, f"product parts allowed to import measurement tools: {leaks}"
    assert not list(PACKAGE.rglob("cli.py")), "the command line belongs to the tools"


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
    on_disk = set().union(*_all_parts().values())
    missing = sorted(on_disk - set(ALLOWED))
    assert not missing, f"parts of deepcompile_remat or dcr_bench without a row in ALLOWED: {missing}"
    overlap = sorted((_parts_on_disk(PACKAGE) & _parts_on_disk(TOOLS)) - {PACKAGE_API, TOOLS_API})
    assert not overlap, f"a part name used in both packages (the table would mix them): {overlap}"
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
                   _imported_parts(source, {fake.name: _parts_on_disk(fake)}, root=fake))
    assert found == [(2, "zero3"), (3, "zero3"), (4, "partition"), (5, PACKAGE_API), (5, "zero3")]


def test_the_compile_cache_key_covers_the_product_only(tmp_path):
    """Editing a benchmark must not make users' inductor caches miss (the key hashes the
    product's sources), and editing the product must (else a stale cached cut is reused)."""
    import shutil

    from deepcompile_remat import backends

    hashed = backends.source_files()
    assert hashed and all(PACKAGE in p.parents for p in hashed)
    assert PACKAGE / "partition" / "cut.py" in hashed
    assert PACKAGE / "planning" / "partition_fn.py" in hashed
    assert not [p for p in hashed if TOOLS in p.parents]

    tree = tmp_path / "tree"
    shutil.copytree(PACKAGE, tree / "deepcompile_remat",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copytree(TOOLS, tree / "benchmarks" / "dcr_bench",
                    ignore=shutil.ignore_patterns("__pycache__"))
    product = tree / "deepcompile_remat"
    key = backends.digest_of(product)
    with open(tree / "benchmarks" / "dcr_bench" / "profile" / "compare.py", "a") as f:
        f.write("\n# a benchmark edit\n")
    assert backends.digest_of(product) == key
    with open(product / "partition" / "cse.py", "a") as f:
        f.write("\n# a product edit\n")
    assert backends.digest_of(product) != key


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_imports(root: Path) -> dict[str, set[str]]:
    """module -> the modules of its own part it imports (function-level and relative imports
    included). `from pkg import x` is an import of pkg.x where that is a module, else of pkg;
    an import of a package enclosing the importer is left out: it is initialised first anyway."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                module = ".".join(base + (node.module.split(".") if node.module else []))
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module
                           for a in node.names]
            else:
                continue
            imported |= {t for t in targets if t in modules and t != name
                         and not name.startswith(t + ".")
                         and t.split(".")[:2] == name.split(".")[:2]}  # same part
        graph[name] = imported
    return graph


def _module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle once, as the path that closes it (depth-first)."""
    cycles, done, on_path = [], set(), []

    def visit(module):
        if module in on_path:
            cycles.append(on_path[on_path.index(module):] + [module])
            return
        if module in done:
            return
        on_path.append(module)
        for imported in sorted(graph[module]):
            visit(imported)
        on_path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    return cycles


def test_no_module_cycle_inside_a_part():
    """Before: deepspeed/engine.py and deepspeed/takeover.py imported each other (take_over /
    requested_kind), hidden by function-level imports; the table above only sees parts. A
    cycle inside a part (function-level imports included) is an error too."""
    cycles = [c for root in PACKAGES.values() for c in _module_cycles(_module_imports(root))]
    assert not cycles, "import cycles inside a part:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_module_cycle_check_sees_a_function_level_cycle(tmp_path):
    """The check finds a cycle made of a module-level and a function-level import."""
    fake = tmp_path / "deepcompile_remat"
    (fake / "deepspeed").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "deepspeed" / "__init__.py").write_text("from .engine import go\n")
    (fake / "deepspeed" / "engine.py").write_text(
        "def go():\n    from deepcompile_remat.deepspeed.takeover import run\n")
    (fake / "deepspeed" / "takeover.py").write_text(
        "from deepcompile_remat.deepspeed import engine, config\n")
    (fake / "deepspeed" / "config.py").write_text("from deepcompile_remat import deepspeed\n")
    cycles = _module_cycles(_module_imports(fake))
    assert cycles == [["deepcompile_remat.deepspeed.engine", "deepcompile_remat.deepspeed.takeover",
                       "deepcompile_remat.deepspeed.engine"]], cycles


# The runtime's ops by name: the partition library must name none of them (it proposes cuts and
# extracts graphs for any graph; what a ZeRO-3 op is, the runtime says through node.meta).
ZERO3_OP_NAMES = ("allgather_cast", "reduce_scatter_grad", "secondary_shard",
                  "allreduce_replicas")


def test_the_partition_library_names_no_zero3_op():
    """Guards against the partitioner special-casing a runtime op again (op_classes.py named
    dcr::secondary_shard) or formatting the runtime's figures (report.py named secondary_*)."""
    offenders = [f"{path.relative_to(PACKAGE)}: {name}"
                 for path in sorted((PACKAGE / "partition").rglob("*.py"))
                 for name in (*ZERO3_OP_NAMES, "secondary_")
                 if name in path.read_text()]
    assert not offenders, offenders
