"""Gathered copies that refuse writes: a write to one would be lost, silently.

Outside torch.compile, reading a sharded parameter (``module.weight``) gathers a fresh full
tensor. Writing into it (``nn.init.zeros_(m.weight)``, ``m.weight.data.normal_()``,
``m.weight[0] = 1``, ``m.weight.requires_grad = False``) would change that copy, never the
shard the optimizer steps on. The copy is therefore a ``GatheredCopy``: every op on it runs as
on a plain tensor (results are plain tensors, autograd unchanged), except writes, which raise
an error that names the parameter and says how to write (zero3.gathered_parameters). Views and
``.data`` of a copy are guarded too, since writing through them is the same lost write.

Inside a compiled graph the property returns a plain tensor (nothing can write to it there
that torch would not reject anyway), so compiled code pays nothing.
"""
from __future__ import annotations

import torch

# In-place ops whose names do not end in "_" (Python's augmented assignments, item writes).
_DUNDER_WRITES = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
    "__imatmul__"})
# Names ending in "_" that do not write the values.
_NOT_WRITES = frozenset({"retain_grad", "share_memory_", "is_shared", "record_stream"})


def _is_write(func, kwargs) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__set__":  # a tensor attribute assigned: .data, .requires_grad, .grad
        return True
    if name in _DUNDER_WRITES or "out" in (kwargs or {}):
        return True
    return name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITES


class GatheredCopy(torch.Tensor):
    """A gathered full parameter handed out outside compiled code. `_dcr_source` is
    (module, name) of the sharded parameter it was gathered from."""

    _dcr_source: tuple

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        copy = next((a for a in args if isinstance(a, GatheredCopy)), None)
        if copy is None:  # a GatheredCopy in a list argument or in out=: find it there
            for a in (*args, *kwargs.values()):
                if isinstance(a, (list, tuple)):
                    copy = next((x for x in a if isinstance(x, GatheredCopy)), None)
                elif isinstance(a, GatheredCopy):
                    copy = a
                if copy is not None:
                    break
        if copy is not None and _is_write(func, kwargs):
            raise RuntimeError(write_error(copy._dcr_source, getattr(func, "__name__", func)))
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if copy is None:
            return result
        return _guard_aliases(result, copy)


def _guard_aliases(result, copy: GatheredCopy):
    """Views of the copy (and its .data) stay guarded; everything else is a plain tensor."""
    if isinstance(result, (list, tuple)):
        return type(result)(_guard_aliases(r, copy) for r in result)
    if not isinstance(result, torch.Tensor) or isinstance(result, GatheredCopy):
        return result
    with torch._C.DisableTorchFunctionSubclass():
        same = result.untyped_storage().data_ptr() == copy.untyped_storage().data_ptr()
    return guard(result, copy._dcr_source) if same else result


def guard(full: torch.Tensor, source: tuple) -> GatheredCopy:
    """`full` as a GatheredCopy of the parameter `source` ((module, name)): same storage,
    writes refused."""
    out = full.as_subclass(GatheredCopy)
    out._dcr_source = source
    return out


def write_error(source: tuple, op: str) -> str:
    """The error message for `op` writing to a gathered copy of `source`: what would be lost,
    and how to write instead."""
    module, name = source
    cls = getattr(type(module), "_dcr_unsharded_class", type(module))
    return (
        f"deepcompile_remat.zero3: {op} writes to {cls.__name__}.{name}, a sharded "
        f"parameter: what you hold is a gathered copy and the write would be lost (the shard "
        f"the optimizer steps on would not change). Write inside "
        f"`with deepcompile_remat.zero3.gathered_parameters(model, modifier_rank=0):`, where "
        f"parameters are full nn.Parameters and are re-sharded on exit; or load full tensors "
        f"with load_state_dict().")
