"""held_bytes(engine): every tensor byte a DeepSpeed ZeRO-3 engine holds, by owner.

What a rank holds between steps is the sum of a few large buffers whose owners are spread over
the engine, its ZeRO-3 optimizer and the torch optimizer inside it, and some of them alias one
another (under torch_autocast DeepSpeed's fp32 partitions are its parameter partitions). To say
where the bytes are, every tensor reachable from those three objects is collected, each storage
counted once, under the first owner that reaches it in this order:

  parameter partitions   param.ds_tensor of every module parameter (the flat 16-bit, or fp32
                         under torch_autocast, partitions; a takeover under "bf16" drops
                         the 16-bit ones: meta placeholders, no bytes)
  gathered parameters    param.data of a parameter that is not released (persistent ones)
  fp32 partitions        the optimizer's fp32_partitioned_groups_flat (master weights)
  gradient partitions    grad_partitions_flat_buffer (every parameter's averaged gradient slot)
  optimizer states       the torch optimizer's state (AdamW's exp_avg and exp_avg_sq)
  fp32 gradients         .grad of the fp32 partitions, if the step left one set
  reduce buckets         ipg_buckets[dtype].buffer (DeepSpeed's gradient hooks' buckets)
  <attribute>            anything else, under the engine or optimizer attribute it hangs from

Bytes on the host are kept apart from the accelerator's: their owner is suffixed " [host]"
("optimizer states [host]"), and HeldBytes.on_accelerator / on_host sum each side. A tensor
is on the host when it is on the CPU while DeepSpeed's accelerator is not, or when DeepSpeed
placed it there for offload (the fp32 partitions, their gradients and the optimizer states
under offload_optimizer "cpu"; the 16-bit parameter partitions under offload_param "cpu"): on
a CPU accelerator that memory is the same, and the split still says what a GPU run would hold
where.

An alias is reported once under its first owner and listed in ``aliases`` (owner -> the owner
it shares storage with), so a reader sees what was not copied. Bytes are storage bytes: a
view counts its whole storage once. Reads DeepSpeed's accelerator (its device) and the
attributes DeepSpeed 0.19.8 sets (adapter.py lists the private ones). Meta tensors (what the
takeover leaves where it freed a buffer) hold no bytes and are skipped."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepcompile_remat.deepspeed._ds_internals import accelerator_device

_MAX_DEPTH = 4  # how far into lists, tuples and dicts under an attribute the sweep looks
HOST = " [host]"  # the suffix of an owner's bytes held on the host
# What DeepSpeed's ZeRO-3 puts on the host under offload_optimizer (stage3: self.device "cpu")
_OFFLOADED_WITH_THE_OPTIMIZER = ("fp32 partitions", "fp32 gradients", "optimizer states")
# ... and under offload_param (the 16-bit partitions: fp16_partitioned_groups_flat on the host)
_OFFLOADED_WITH_THE_PARAMETERS = ("parameter partitions", "optimizer.fp16_partitioned_groups_flat")


@dataclass
class HeldBytes:
    """Bytes per owner (storage bytes, each storage counted once), and which owners alias an
    earlier one instead of holding bytes of their own."""

    by_owner: dict = field(default_factory=dict)  # owner -> bytes, in the order above
    aliases: dict = field(default_factory=dict)  # owner -> the owner whose storage it shares

    @property
    def total(self) -> int:
        """Every owner's bytes together, the accelerator's and the host's."""
        return sum(self.by_owner.values())

    @property
    def on_host(self) -> int:
        """The bytes held on the host (owners suffixed HOST)."""
        return sum(n for owner, n in self.by_owner.items() if owner.endswith(HOST))

    @property
    def on_accelerator(self) -> int:
        """The bytes held on the accelerator."""
        return self.total - self.on_host

    def table(self, numel: int = 0) -> str:
        """One line per owner: MiB, and bytes per model parameter when numel is given."""
        lines = []
        for owner, n in self.by_owner.items():
            per = f"  {n / numel:5.2f} B/param" if numel else ""
            lines.append(f"  {owner:<28} {n / 2**20:9.2f} MiB{per}")
        for owner, first in self.aliases.items():
            lines.append(f"  {owner:<28}  (aliases {first}: no bytes of its own)")
        sides = ([("on the accelerator", self.on_accelerator), ("on the host", self.on_host)]
                 if self.on_host else [])
        for label, n in sides + [("total", self.total)]:
            per = f"  {n / numel:5.2f} B/param" if numel else ""
            lines.append(f"  {label:<28} {n / 2**20:9.2f} MiB{per}")
        return "\n".join(lines)


def _tensors(obj, depth: int = 0):
    """Every tensor in obj, looking into lists, tuples, dicts and sets up to _MAX_DEPTH."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < _MAX_DEPTH:
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield from _tensors(k, depth + 1)
                yield from _tensors(v, depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for v in obj:
                yield from _tensors(v, depth + 1)


class _Ledger:
    def __init__(self, accelerator: "str | None", offloaded: tuple = ()):
        self.owner_of: dict = {}  # storage key -> owner
        self.result = HeldBytes()
        self.accelerator, self.offloaded = accelerator, offloaded

    def _on_host(self, owner: str, t: torch.Tensor) -> bool:
        return (owner in self.offloaded
                or (t.device.type == "cpu" and self.accelerator not in (None, "cpu")))

    def add(self, name: str, tensors) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            if t.device.type == "meta" or storage.nbytes() == 0:
                continue
            owner = name + HOST if self._on_host(name, t) else name
            key = (t.device, storage.data_ptr())
            first = self.owner_of.get(key)
            if first is None:
                self.owner_of[key] = owner
                self.result.by_owner[owner] = self.result.by_owner.get(owner, 0) + storage.nbytes()
            elif first != owner and owner not in self.result.by_owner:
                self.result.aliases.setdefault(owner, first)


def held_bytes(engine, *, device: str | torch.device | None = None) -> HeldBytes:
    """What `engine` (a DeepSpeed ZeRO-3 engine, taken over or not) holds now, by owner (module
    docstring), the host's bytes apart. `device`: count only tensors on that device type
    (default: the accelerator's and the host's)."""
    module, optimizer = engine.module, engine.optimizer
    inner = getattr(optimizer, "optimizer", None)
    params = list(module.parameters())
    # DeepSpeed's own: under offload_param and offload_optimizer no partition is on it
    accelerator = accelerator_device().type
    counted = ({torch.device(device).type} if device is not None
               else {accelerator, "cpu"})
    offloaded = (_OFFLOADED_WITH_THE_OPTIMIZER if getattr(optimizer, "offload_optimizer", False)
                 else ()) + (_OFFLOADED_WITH_THE_PARAMETERS
                             if getattr(optimizer, "offload_param", False) else ())
    ledger = _Ledger(accelerator, offloaded)
    keep = (lambda ts: [t for t in ts if not counted or t.device.type in counted])

    ledger.add("parameter partitions", keep(p.ds_tensor for p in params if hasattr(p, "ds_tensor")))
    ledger.add("gathered parameters", keep(p.data for p in params if p.numel() > 0))
    fp32 = list(getattr(optimizer, "fp32_partitioned_groups_flat", []) or [])
    ledger.add("fp32 partitions", keep(fp32))
    grads = getattr(optimizer, "grad_partitions_flat_buffer", None)
    ledger.add("gradient partitions", keep([grads] if grads is not None else []))
    if inner is not None:
        ledger.add("optimizer states", keep(_tensors(dict(inner.state))))
    ledger.add("fp32 gradients", keep(t.grad for t in fp32 if t.grad is not None))
    buckets = getattr(optimizer, "ipg_buckets", {}) or {}
    ledger.add("reduce buckets", keep(getattr(b, "buffer", None) for b in buckets.values()
                                      if getattr(b, "buffer", None) is not None))
    # The sweep: whatever else hangs from the three objects, under its attribute's name.
    for prefix, obj in (("optimizer", optimizer), ("engine", engine), ("torch optimizer", inner)):
        for name, value in sorted(vars(obj).items()) if obj is not None else ():
            if name in ("module", "optimizer", "state", "param_groups"):
                continue
            ledger.add(f"{prefix}.{name}", keep(_tensors(value)))
    return ledger.result
