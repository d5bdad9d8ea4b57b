"""The layers of DESIGN.md stay layers: the partitioner knows nothing of ZeRO-3 (the runtime
plugs in through PartitionHook) and the ZeRO-3 runtime does not reach into the partitioner;
shared FX facts live in deepcompile_remat.fx_values. Guards against the import cycle
partition <-> zero3 growing back."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "deepcompile_remat"


def _imports(folder: str) -> set[str]:
    names = set()
    for path in (PACKAGE / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("folder, forbidden", [("partition", "deepcompile_remat.zero3"),
                                               ("zero3", "deepcompile_remat.partition")])
def test_no_import_across_layers(folder, forbidden):
    crossing = sorted(n for n in _imports(folder) if n == forbidden or n.startswith(forbidden + "."))
    assert crossing == [], f"{folder}/ imports {crossing}"
