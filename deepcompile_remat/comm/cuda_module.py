"""The optional _cuda extension: loading it, saying why it is missing or unusable, and the
private NCCL communicator the kernel benchmark compares with.

usable(): the module is built, imports, and was compiled for a CUDA this torch and this driver
run (same major version as torch.version.cuda; no newer than the driver supports). Otherwise
the runtime warns once, saying which, and casts with torch (cast_and_gather.fill_slots): a
kernel built for another CUDA fails to launch, or worse, on a user's GPUs.

Communicators (benchmarks/bench_allgather_cast.py only: the runtime gathers through the process
group, one communicator for every collective): one per (process group, device), created on
first use from a unique id that group rank 0 generates and broadcasts through the
torch.distributed group, cached, destroyed by destroy_communicators() (the benchmark calls it;
nothing is registered at import).
"""
from __future__ import annotations

import functools
import json
import logging
import threading
from pathlib import Path
from typing import Dict, Tuple

import torch
import torch.distributed as dist

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
    if _cuda is not None:
        info["nccl_version"] = _cuda.nccl_version
    return info


def cuda_available() -> bool:
    """True when the _cuda module is importable (nvcc + NCCL were found at build time)."""
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
    if _cuda is None:
        info = cuda_build_info()
        why = info.get("reason") or ""
        if info.get("import_error"):
            why = f"{why}; import failed: {info['import_error']}".lstrip("; ")
        raise RuntimeError(
            "deepcompile_remat was built without its CUDA module (deepcompile_remat._cuda), "
            f"so cast_and_gather cannot run on CUDA tensors: {why}. Rebuild with nvcc and the "
            "NCCL headers available (scripts/install_cuda_deps.sh).")
    return _cuda


_lock = threading.Lock()
_communicators: Dict[Tuple[object, int], object] = {}
_comm_streams: Dict[int, torch.cuda.Stream] = {}


def _group_key(group) -> object:
    return "default" if group is None else group


def communicator(group, device: torch.device):
    """The cached NCCL communicator of `group` on `device` (created collectively on first use:
    every rank of the group must call this in the same order, like any collective)."""
    key = (_group_key(group), device.index)
    with _lock:
        comm = _communicators.get(key)
    if comm is not None:
        return comm
    cuda = require_cuda_module()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    payload = [cuda.nccl_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group or dist.group.WORLD, 0),
                               group=group)
    comm = cuda.NcclCommunicator(payload[0], world, rank, device.index)
    with _lock:
        _communicators[key] = comm
    return comm


def comm_stream(device: torch.device) -> torch.cuda.Stream:
    """The benchmark's side stream per device, for the private communicator's gathers."""
    with _lock:
        stream = _comm_streams.get(device.index)
        if stream is None:
            stream = _comm_streams[device.index] = torch.cuda.Stream(device=device)
        return stream


def destroy_communicators() -> None:
    """ncclCommDestroy every cached communicator (idempotent). Call before destroying groups."""
    with _lock:
        comms = list(_communicators.values())
        _communicators.clear()
    for comm in comms:
        comm.destroy()
