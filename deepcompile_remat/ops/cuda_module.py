"""The optional _cuda extension: loading it, saying why it is missing, NCCL communicators.

Communicators (benchmarks only: the runtime gathers through the process group, one
communicator for every collective; benchmarks/bench_allgather_cast.py times this private one
against it): one per (process group, device), created on first use from a unique id that
group rank 0 generates and broadcasts through the torch.distributed group, cached, destroyed
by destroy_communicators() (also registered with atexit, before torch tears groups down).
"""
from __future__ import annotations

import atexit
import json
import threading
from pathlib import Path
from typing import Dict, Tuple

import torch
import torch.distributed as dist

_INFO_FILE = Path(__file__).resolve().parent.parent / "_cuda_build_info.json"

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


def require_cuda_module():
    if _cuda is None:
        info = cuda_build_info()
        why = info.get("reason") or ""
        if info.get("import_error"):
            why = f"{why}; import failed: {info['import_error']}".lstrip("; ")
        raise RuntimeError(
            "deepcompile_remat was built without its CUDA module (deepcompile_remat._cuda), "
            f"so allgather_cast cannot run on CUDA tensors: {why}. Rebuild with nvcc and the "
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
    """One side stream per device for the casts and gathers."""
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


atexit.register(destroy_communicators)
