"""DeepSpeedAdapter: every patch deepcompile_remat makes to DeepSpeed, made, recorded and undone
in one place; and the start-up check that DeepSpeed has each attribute the takeover uses.

    check_deepspeed()                       # classes and modules, before the engine is built
    adapter = DeepSpeedAdapter("takeover")  # one per engine
    adapter.check_engine(engine)            # its instance attributes, before any patch
    adapter.wrap(optimizer, "step", lambda step: stepping_then_releasing(step))
    ...
    adapter.undo()                          # engine.destroy() or uninstall(): newest first

A patch is a setattr on a DeepSpeed object, class or module (or on torch.nn.functional, where
DeepSpeed put its own linear): a method or function replaced by ours, a hook handle or flag
set, an attribute added (engine.dcr_takeover). Each is recorded as a Patch (the owner, the
attribute, the value before) and undo() puts the value before back, or removes the owner's own
attribute where it had none (a method read from its class). Not recorded: the takeover's
handling of DeepSpeed's *data* (_ds_internals.py frees, re-points and brings back tensors:
reduce buckets, gradient slots, 16-bit partitions), since a record of their old values would
keep the memory they hold alive; before undo() the takeover gives DeepSpeed that data back in
DeepSpeed's own layout (the callbacks registered with before_undo()). What the takeover removes
for good (DeepSpeed's gather and gradient hooks) stays removed: an engine whose takeover was
undone is DeepSpeed's again in every attribute, but not one to train with.

A patch of something the whole process shares (torch.nn.functional.linear) is made through
share(): it stays while any adapter that shares it lives, and the last one to undo puts the
value before back, so one engine's undo never changes what another engine's takeover needs.

The check: every attribute in REQUIRED_CLASS_ATTRIBUTES and REQUIRED_INSTANCE_ATTRIBUTES must
exist; a DeepSpeed without one is an error that names it, e.g. "DeepSpeed 0.20.0:
DeepSpeedZeroOptimizer_Stage3._optimizer_step is missing; the takeover was written for 0.19.8",
raised before DeepSpeed builds the engine (classes) or before the first patch (instances). A
DeepSpeed of another version with every attribute in place logs a warning once.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)

DEEPSPEED_VERSION_WRITTEN_FOR = "0.19.8"

_STAGE3 = ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3")
# What of DeepSpeed reads or writes the 16-bit parameter partitions outside the forward,
# backward and step the takeover runs: checkpoint loads, refresh_fp32_params,
# offload/reload_states (_ds_internals.SixteenBitPartitions brings them back first).
OPTIMIZER_METHODS_READING_16BIT = (
    "load_state_dict", "refresh_fp32_params", "_restore_from_bit16_weights",
    "offload_states", "reload_states", "load_hp_checkpoint_state_from_checkpoint_dir_stage3",
    "load_module_checkpoint_state_from_checkpoint_dir_stage3")
# Gathers of a parameter (GatheredParameters, 16-bit model saves): methods every ZeRO-3
# parameter carries (set on each parameter by DeepSpeed, not on a class).
PARAMETER_METHODS_READING_16BIT = ("all_gather", "all_gather_coalesced")

# The ZeRO-3 optimizer's ds_id -> gradient slot map (name-mangled: a private attribute of
# DeepSpeedZeroOptimizer_Stage3), which _ds_internals reads and rewrites.
GRAD_PARTITION_MAP = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"
# (module, class or None) -> the attributes read or replaced there, looked up on the class.
REQUIRED_CLASS_ATTRIBUTES: dict = {
    ("deepspeed", None): ("initialize", "init_distributed", "__version__"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine"): (
        "compile", "destroy", "get_deepspeed_compile_backend", "zero_optimization_stage",
        "zero_offload_optimizer", "zero_offload_param", "zero_hpz_partition_size",
        "gradient_predivide_factor", "zero_quantized_weights",
        "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "zenflow_config"),
    _STAGE3: ("step", "destroy", "independent_gradient_partition_epilogue",
              "_create_fp32_partitions",
              "_prepare_fp32_grad_for_sub_group", "unscale_and_clip_grads",
              "_reassign_or_swap_out_partitioned_parameters", "_optimizer_step", "loss_scale",
              "_offload_grad_partition_at_boundary", "is_gradient_accumulation_boundary",
              "get_param_id",
              *OPTIMIZER_METHODS_READING_16BIT),
    ("deepspeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload"): (
        "_remove_module_hooks",),
    ("deepspeed.runtime.zero.partition_parameters", None): (
        "ZeroParamStatus", "InsertPostInitMethodToModuleSubClasses"),
}
# With DeepCompile on: the module-global partitioner deepcompile.py swaps while it compiles.
REQUIRED_FOR_DEEPCOMPILE: dict = {
    ("deepspeed.compile.backend", None): ("min_cut_rematerialization_partition",),
}
# What DeepSpeed sets on each object when it builds the engine (not on a class).
REQUIRED_INSTANCE_ATTRIBUTES: dict = {
    "engine": ("module", "optimizer", "module_forward_pre_hook", "module_forward_post_hook"),
    "optimizer": (
        "optimizer", "parameter_offload", "_grad_acc_hooks", "_leaf_module_hooks", "ipg_buckets",
        "fp16_groups", "fp16_partitioned_groups_flat", "fp32_partitioned_groups_flat",
        "averaged_gradients", "grad_partitions_flat_buffer", GRAD_PARTITION_MAP, "micro_step_id",
        "sub_group_to_group_id", "clip_grad", "persistent_parameters", "offload_optimizer",
        "offload_param", "dtype", "torch_autocast_gradscaler", "zenflow", "use_muon",
        "grad_position", "_offload_boundary_param_ids"),
    "parameter": ("ds_tensor", "ds_id", "ds_numel", "ds_shape", "ds_process_group", "ds_status",
                  "ds_persist", "partition", "partition_numel",
                  *PARAMETER_METHODS_READING_16BIT),
}

_ABSENT = object()  # Patch.original: the owner had no attribute of its own by that name


def _missing_message(missing: list) -> str:
    import deepspeed

    verb = "is" if len(missing) == 1 else "are"
    return (f"DeepSpeed {deepspeed.__version__}: {', '.join(missing)} {verb} missing; the "
            f"takeover was written for {DEEPSPEED_VERSION_WRITTEN_FOR} "
            "(deepcompile_remat/deepspeed/adapter.py lists what it uses)")


def _missing_in(module_name: str, class_name: "str | None", attributes) -> list:
    """'Owner.attribute' for each of `attributes` absent from the module or its class."""
    try:
        owner = importlib.import_module(module_name)
    except ImportError:
        return [module_name]
    shown = module_name
    if class_name is not None:
        shown = class_name
        if not hasattr(owner, class_name):
            return [f"{module_name}.{class_name}"]
        owner = getattr(owner, class_name)
    return [f"{shown}.{name}" for name in attributes if not hasattr(owner, name)]


_warned_version: list = []


def check_deepspeed(deepcompile: bool = False) -> None:
    """Every class and module attribute the takeover uses (with DeepCompile on: what
    deepcompile.py swaps) exists, else a RuntimeError naming each missing one; another
    DeepSpeed version with all of them in place is a warning (once). Called before DeepSpeed
    builds the engine."""
    import deepspeed

    required = {**REQUIRED_CLASS_ATTRIBUTES, **(REQUIRED_FOR_DEEPCOMPILE if deepcompile else {})}
    missing = [m for (module, cls), names in required.items()
               for m in _missing_in(module, cls, names)]
    if missing:
        raise RuntimeError(_missing_message(missing))
    if deepspeed.__version__ != DEEPSPEED_VERSION_WRITTEN_FOR and not _warned_version:
        _warned_version.append(deepspeed.__version__)
        log.warning("deepcompile_remat: DeepSpeed %s; the takeover was written for %s and every "
                    "attribute it uses is present (deepcompile_remat/deepspeed/adapter.py lists "
                    "them)", deepspeed.__version__, DEEPSPEED_VERSION_WRITTEN_FOR)


def stage3_optimizer_class():
    """DeepSpeed's ZeRO-3 optimizer class (imported on call: importing this module needs no
    DeepSpeed)."""
    return getattr(importlib.import_module(_STAGE3[0]), _STAGE3[1])


def owner_name(owner) -> str:
    """How messages name a patched object: a module or class by its name, an instance by its
    class's."""
    if isinstance(owner, (type, types.ModuleType)):
        return owner.__name__
    return type(owner).__name__


@dataclass(frozen=True, eq=False)  # compared by identity: its values may be tensors
class Patch:
    """One patch: owner.name was `original` (_ABSENT: the owner had none of its own, e.g. a
    method read from its class) and was set to `replacement`; `shared` when made by share()."""

    owner: Any
    name: str
    original: Any
    replacement: Any
    shared: bool = False

    @property
    def had_own(self) -> bool:
        """Whether the owner held an attribute of its own by that name before the patch."""
        return self.original is not _ABSENT

    def __repr__(self) -> str:
        return f"Patch({owner_name(self.owner)}.{self.name})"


def _own(owner, name: str) -> Any:
    """owner's own attribute `name` (in its __dict__), or _ABSENT."""
    return vars(owner).get(name, _ABSENT)


def _put_back(patch: Patch) -> None:
    """owner.name as it was before `patch`, unless something replaced it since (then it stays,
    with a warning: it is not ours to remove)."""
    current = _own(patch.owner, patch.name)
    if current is not patch.replacement:
        log.warning("deepcompile_remat: %s.%s was replaced again after deepcompile_remat "
                    "patched it; left as it is", owner_name(patch.owner), patch.name)
    elif patch.had_own:
        setattr(patch.owner, patch.name, patch.original)
    else:
        delattr(patch.owner, patch.name)


class _SharedPatch:
    """A patch of a process-wide attribute and the adapters that need it (weakly held)."""

    def __init__(self, patch: Patch):
        self.patch = patch
        self.users: weakref.WeakSet = weakref.WeakSet()


_SHARED: dict = {}  # (id(owner), name) -> _SharedPatch
_LIVE: "weakref.WeakSet[DeepSpeedAdapter]" = weakref.WeakSet()  # adapters holding patches


class DeepSpeedAdapter:
    """The patches deepcompile_remat made to one engine's DeepSpeed objects (or, for
    install(), to the deepspeed module), in the order made (module docstring). `label` names
    it in messages. `lasting`: uninstall() leaves it (the import hook's wrapper of
    deepspeed.initialize, autoinstall.py); only its own undo() reverses it."""

    def __init__(self, label: str, lasting: bool = False):
        self.label = label
        self.lasting = lasting
        self.patches: list = []  # Patch, in the order made
        self._before_undo: list = []

    def check_engine(self, engine) -> None:
        """Every instance attribute the takeover reads or patches exists on `engine`, its
        optimizer and its first parameter; a RuntimeError naming each missing one otherwise.
        Called before the first patch."""
        param = next(iter(engine.module.parameters()), None)
        owners = {"engine": engine, "optimizer": getattr(engine, "optimizer", None),
                  "parameter": param}
        missing = [f"{type(obj).__name__}.{name}" for role, obj in owners.items()
                   if obj is not None for name in REQUIRED_INSTANCE_ATTRIBUTES[role]
                   if not hasattr(obj, name)]
        if missing:
            raise RuntimeError(_missing_message(missing))

    def replace(self, owner, name: str, replacement: Any) -> Any:
        """owner.name := replacement, recorded; returns what owner.name read before."""
        before = getattr(owner, name)
        self._record_and_set(Patch(owner, name, _own(owner, name), replacement))
        return before

    def wrap(self, owner, name: str, make: Callable[[Any], Any]) -> Any:
        """owner.name := make(what owner.name is now), recorded; returns the replacement."""
        replacement = make(getattr(owner, name))
        self.replace(owner, name, replacement)
        return replacement

    def add(self, owner, name: str, value: Any) -> None:
        """An attribute of ours on a DeepSpeed object (engine.dcr_takeover), recorded: undo()
        removes it (or puts back what was there)."""
        self._record_and_set(Patch(owner, name, _own(owner, name), value))

    def _record_and_set(self, patch: Patch) -> None:
        self.patches.append(patch)
        setattr(patch.owner, patch.name, patch.replacement)
        if not self.lasting:
            _LIVE.add(self)

    def share(self, owner, name: str, value: Any) -> None:
        """owner.name := value for as long as any adapter sharing it has not undone it (a
        process-wide attribute: module docstring); the value before is put back by the last."""
        key = (id(owner), name)
        shared = _SHARED.get(key)
        if shared is None:
            shared = _SHARED[key] = _SharedPatch(Patch(owner, name, _own(owner, name), value,
                                                       shared=True))
        elif shared.patch.replacement is not value:
            raise RuntimeError(f"deepcompile_remat: {self.label}: {name} is shared with another "
                               "value already")
        shared.users.add(self)
        self._record_and_set(shared.patch)  # set again: DeepSpeed may have set its own since

    @contextlib.contextmanager
    def replaced(self, owner, name: str, value: Any):
        """Context manager: owner.name := value while it is open, recorded, put back on exit."""
        self.replace(owner, name, value)
        patch = self.patches[-1]
        try:
            yield
        finally:
            self.patches.remove(patch)
            _put_back(patch)

    def undo_on_destroy(self, engine) -> None:
        """engine.destroy() undoes this adapter first (this patch included), then runs
        DeepSpeed's destroy on an engine whose attributes are DeepSpeed's own."""

        def undoing_first(destroy):
            def destroy_after_undo(*args, **kwargs):
                self.undo()
                return destroy(*args, **kwargs)

            return destroy_after_undo

        self.wrap(engine, "destroy", undoing_first)

    def before_undo(self, callback: Callable[[], None]) -> None:
        """callback() runs first when undo() runs (the takeover gives DeepSpeed its data back)."""
        self._before_undo.append(callback)

    def undo(self) -> None:
        """The before_undo callbacks, then every patch reversed, newest first: each attribute
        DeepSpeed's own again (a shared one once no other adapter needs it). Idempotent."""
        callbacks, self._before_undo = self._before_undo, []
        for callback in callbacks:
            callback()
        while self.patches:
            patch = self.patches.pop()
            if patch.shared:
                self._release_share(patch)
            else:
                _put_back(patch)
        _LIVE.discard(self)

    def _release_share(self, patch: Patch) -> None:
        key = (id(patch.owner), patch.name)
        shared = _SHARED.get(key)
        if shared is None:
            return
        shared.users.discard(self)
        if not len(shared.users):
            del _SHARED[key]
            _put_back(patch)


def undo_every_adapter() -> None:
    """undo() on every adapter still holding patches but a lasting one (uninstall(): every
    DeepSpeed attribute deepcompile_remat patched is DeepSpeed's own again, deepspeed.initialize
    the import hook's wrapper where the hook made one)."""
    for adapter in list(_LIVE):
        adapter.undo()


def put_back_unrecorded(owner, name: str, value: Any) -> None:
    """owner.name := value where something replaced DeepSpeed's own without a record (by hand:
    `deepspeed.initialize = dcr_ds.initialize`): the one setattr on DeepSpeed outside a patch."""
    setattr(owner, name, value)
