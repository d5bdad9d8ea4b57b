"""The package top (`import deepcompile_remat as dcr`): every public name imports from it,
dir() lists exactly those names, and importing it (or its errors) does not import torch."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import deepcompile_remat as dcr

ROOT = Path(__file__).resolve().parents[2]


def test_every_public_name_imports_from_the_top():
    """Guards against a name in __all__ that the lazy __getattr__ does not know (`from
    deepcompile_remat import X` failing only when a user first asks for it)."""
    for name in dcr.__all__:
        assert getattr(dcr, name) is not None, name
    namespace = {}
    exec("from deepcompile_remat import *", namespace)
    assert set(dcr.__all__) <= set(namespace)


def test_dir_lists_the_public_names():
    """Guards against dir() (tab completion, help()) missing the lazily loaded names, or
    listing the implementation's modules as if they were API."""
    assert sorted(dir(dcr)) == sorted(dcr.__all__)
    assert len(set(dcr.__all__)) == len(dcr.__all__)


def test_the_errors_users_catch_are_at_the_top():
    """Guards against an error the product raises to users being importable only from an
    internal module (BudgetInfeasibleError was only in partition.budget): the top's names are
    the very classes the partitioner, the budget mode and the solver raise."""
    from deepcompile_remat import mincut
    from deepcompile_remat.partition import budget, cut
    from deepcompile_remat.planning import peak_target

    assert dcr.PartitionConflictError is cut.PartitionConflictError
    assert dcr.BudgetInfeasibleError is budget.BudgetInfeasibleError
    assert dcr.UnboundedCutError is mincut.UnboundedCutError
    assert dcr.PeakTargetInfeasibleError is peak_target.PeakTargetInfeasibleError
    for err in (dcr.PartitionConflictError, dcr.BudgetInfeasibleError, dcr.UnboundedCutError,
                dcr.PeakTargetInfeasibleError):
        assert issubclass(err, ValueError) and err.__doc__, err
    try:
        mincut.min_st_cut(2, [0], [1], [float("inf")], 0, 1)
    except dcr.UnboundedCutError as err:
        assert list(err.path) == [0, 1]
    else:
        raise AssertionError("an all-infinite path must raise UnboundedCutError")


def test_import_and_errors_need_no_torch():
    """Guards against the package top importing torch (the solver and the config work
    without it): a fresh interpreter imports the package, its config and its errors, and
    torch is still not loaded; asking for a torch-dependent name then loads it."""
    code = (
        "import sys\n"
        "import deepcompile_remat as dcr\n"
        "from deepcompile_remat import (BudgetInfeasibleError, PartitionConflictError,\n"
        "                               PeakTargetInfeasibleError, RematConfig,\n"
        "                               UnboundedCutError)\n"
        "RematConfig(memory_budget=0)\n"
        "dir(dcr)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "dcr.make_partition_fn\n"
        "assert 'torch' in sys.modules\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
