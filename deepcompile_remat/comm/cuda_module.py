"""The optional _cuda extension (the CUDA cast kernel): loading it, and saying why it is missing
or unusable.

usable(): the module is built, imports, and was compiled for a CUDA this torch and this driver
run (same major version as torch.version.cuda; no newer than the driver supports). Otherwise
the runtime warns once, saying which, and casts with torch (cast_and_gather.fill_slots): a
kernel built for another CUDA fails to launch, or worse, on a user's GPUs. The gathers always
run through torch's process group.
"""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch

_INFO_FILE = Path(__file__).resolve().parent.parent / "_cuda_build_info.json"
log = logging.getLogger(__name__)

try:
    from deepcompile_remat import _cuda  # type: ignore[attr-defined]
    _IMPORT_ERROR = None
except ImportError as e:  # not built, or its shared libraries are missing at run time
    _cuda = None
    _IMPORT_ERROR = str(e)


def cuda_build_info() -> dict:
    """What the build found: {'built', 'reason', 'cuda_compiler', ..., 'import_error'}."""
    try:
        info = json.loads(_INFO_FILE.read_text())
    except (OSError, ValueError):
        info = {"built": False,
                "reason": "no _cuda_build_info.json: the native build did not run the CUDA step "
                          "(DCR_BUILD_CUDA=OFF or an old build)"}
    info["import_error"] = _IMPORT_ERROR
    return info


def cuda_available() -> bool:
    """True when the _cuda module is importable (nvcc was found at build time)."""
    return _cuda is not None


def _major_minor(version) -> tuple:
    parts = str(version).split(".")
    return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0


def incompatibility(built_with, torch_cuda, driver_cuda) -> str | None:
    """Why a module built with CUDA `built_with` ("13.0.88") cannot run next to a torch built
    with `torch_cuda` ("13.0"; None: a CPU build) on a driver supporting `driver_cuda` (13000,
    cudaDriverGetVersion's encoding; None: unknown); None when it can."""
    if not built_with:
        return "the build recorded no CUDA version"
    built = _major_minor(built_with)
    if torch_cuda is not None and _major_minor(torch_cuda)[0] != built[0]:
        return (f"it was built with CUDA {built_with} but this torch uses CUDA {torch_cuda} "
                "(another major version: another runtime)")
    if driver_cuda:
        driver = (driver_cuda // 1000, (driver_cuda % 1000) // 10)
        if driver < built:
            return (f"it was built with CUDA {built_with} but the driver supports CUDA "
                    f"{driver[0]}.{driver[1]} at most")
    return None


def _driver_cuda_version():
    try:
        return int(torch._C._cuda_getDriverVersion())
    except (AttributeError, RuntimeError):
        return None


@functools.lru_cache(maxsize=1)
def usable() -> bool:
    """Built, importable, and compatible with this torch and driver (module docstring); warns
    once, naming the mismatch, when built but not compatible."""
    if _cuda is None:
        return False
    why = incompatibility(cuda_build_info().get("cuda_compiler_version"), torch.version.cuda,
                          _driver_cuda_version() if torch.cuda.is_available() else None)
    if why is not None:
        log.warning("deepcompile_remat: not using its CUDA cast kernel: %s. Casting with torch "
                    "and gathering through the process group instead (correct, one launch per "
                    "shard); rebuild deepcompile_remat against this torch's CUDA to fuse.", why)
        return False
    return True


def require_cuda_module():
    """The _cuda module; a RuntimeError saying why when it was not built or does not import."""
    if _cuda is None:
        info = cuda_build_info()
        why = info.get("reason") or ""
        if info.get("import_error"):
            why = f"{why}; import failed: {info['import_error']}".lstrip("; ")
        raise RuntimeError(
            "deepcompile_remat was built without its CUDA module (deepcompile_remat._cuda), "
            f"so its CUDA cast kernel cannot run: {why}. Rebuild with nvcc available "
            "(the CUDA toolkit, or CUDACXX pointing at nvcc).")
    return _cuda
