"""torch.compile backends that partition with deepcompile_remat.

    model = torch.compile(model, backend=deepcompile_remat.backend("inductor", config))

"eager": AOTAutograd with our partition_fn; the forward and backward FX graphs run as they are.
"inductor": inductor, with our partitioner installed through the supported hook
``torch._inductor.config.custom_partitioner_fn`` for the duration of the compile (no
monkeypatching). Either way, graph inputs that arrive as ``nn.Parameter`` are the parameters
the ZeRO-3 marking protects, unless the config names them explicitly.

``backend(kind, config, on_partition=fn)`` calls ``fn(fw_module, bw_module, example_inputs)``
right after each joint graph is partitioned and before the two graphs are compiled (inductor
rewrites them in place afterwards), whichever partitioner runs: ours, or torch's when the config
is disabled. The measurements (``deepcompile-remat profile``) read the saved values and predict
peaks there. Under inductor, an AOTAutograd cache hit skips partitioning, so on_partition sees
nothing: turn ``torch._inductor.config.fx_graph_cache`` and
``torch._functorch.config.enable_autograd_cache`` off where every partition must be seen. The
PartitionReports survive such a hit (partition/report_cache.py): reports() gets the ones
recorded when the cache entry was written, marked from_cache. Where the graph's collectives
span ranks, the hit offers its cut to the job's other ranks, and a hit whose cut is not the
job's is compiled again without that cache (planning/agreement.py).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from deepcompile_remat import planning
from deepcompile_remat.planning import agreement
from deepcompile_remat.config import RematConfig
from deepcompile_remat.partition import report_cache
from deepcompile_remat.zero3.topology import Topology, topology_of


def make_partition_fn(config: Optional[RematConfig] = None, *,
                      parameter_indices: Optional[Sequence[int]] = None,
                      num_graph_inputs: Optional[int] = None,
                      topology: Optional[Topology] = None,
                      fuses_pointwise: bool = True) -> Callable:
    """The AOTAutograd partition function for `config` (None: RematConfig()): the planning
    layer (our min-cut, the ZeRO-3 runtime's passes: cast-before-gather, re-gather schedule),
    what both backends use. A disabled config (RematConfig(enabled=False)) gives torch's own
    min_cut_rematerialization_partition: off means off wherever the config is passed.
    topology: the process-group layout (zero3/topology.py; None: read from each joint graph).
    fuses_pointwise: whether the graphs' compiler is inductor (True), which fuses pointwise
    ops into their consumers (peak-target mode's memory simulation) and saves conv weights as
    channels-last copies (the cut prices them), or the eager backend (False)."""
    config = _checked_config(config)
    if not config.enabled:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        return min_cut_rematerialization_partition
    return planning.remat_partition_fn(config, parameter_indices=parameter_indices,
                                       num_graph_inputs=num_graph_inputs, topology=topology,
                                       fuses_pointwise=fuses_pointwise)


def _checked_config(config: Optional[RematConfig]) -> RematConfig:
    """config, or RematConfig() for None; anything else than a RematConfig is a TypeError."""
    config = config if config is not None else RematConfig()
    if not isinstance(config, RematConfig):
        raise TypeError(f"config must be a RematConfig, got {type(config).__name__}")
    return config


def partition_fn(joint_module, joint_inputs, *, num_fwd_outputs, **kwargs):
    """The default partition function (RematConfig(), ZeRO-3 passes on): drop-in for
    AOTAutograd."""
    return make_partition_fn()(joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                               **kwargs)


def parameter_indices_of(example_inputs: Sequence[Any]) -> list[int]:
    """The positions of the nn.Parameter inputs: the parameters the marking protects."""
    return [i for i, x in enumerate(example_inputs) if isinstance(x, torch.nn.Parameter)]


def _parameters(config: RematConfig, example_inputs: Sequence[Any]) -> Sequence[int]:
    if config.parameter_indices is not None:  # explicit, even when empty
        return config.parameter_indices
    return parameter_indices_of(example_inputs)


def source_files(root: Optional[Path] = None) -> list[Path]:
    """The files the compile-cache key hashes: the product's Python sources and its native
    module, nothing else (the measurement tools live apart, in benchmarks/dcr_bench, so
    editing a benchmark never makes a user's cache miss). root: the package folder."""
    root = root if root is not None else Path(__file__).resolve().parent
    return sorted(root.rglob("*.py")) + sorted(root.glob("_C*.so"))


def digest_of(root: Path) -> str:
    """sha256 over source_files(root): each file's path below root and its bytes."""
    h = hashlib.sha256()
    for path in source_files(root):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    """Hash of the product's sources and native module: part of the cache key."""
    return digest_of(Path(__file__).resolve().parent)


def _observed(partition: Callable, on_partition: Optional[Callable], example_inputs) -> Callable:
    """`partition`, reporting each (fw, bw) pair to on_partition before anyone compiles it."""
    if on_partition is None:
        return partition

    def observed(joint, joint_inputs, **kwargs):
        fw, bw = partition(joint, joint_inputs, **kwargs)
        on_partition(fw, bw, example_inputs)
        return fw, bw

    return observed


class RematPartitioner(CustomPartitionerFn):
    """make_partition_fn(config) behind inductor's custom-partitioner hook: ours, or torch's
    min-cut (called as inductor calls it) when the config is disabled."""

    def __init__(self, config: RematConfig, parameter_indices: Optional[Sequence[int]],
                 num_graph_inputs: Optional[int] = None, on_partition: Optional[Callable] = None,
                 example_inputs: Sequence[Any] = (), topology: Optional[Topology] = None
                 ) -> None:
        self.config = config
        self.parameter_indices = None if parameter_indices is None else tuple(parameter_indices)
        self.num_graph_inputs = num_graph_inputs
        self.topology = topology
        self._partition_fn = _observed(
            make_partition_fn(config, parameter_indices=self.parameter_indices,
                              num_graph_inputs=num_graph_inputs, topology=topology),
            on_partition, example_inputs)

    def __reduce__(self):
        # inductor pickles its config into the FX-graph cache key; the bound partition_fn is a
        # closure, so pickle what it is built from (else every compile misses the cache).
        return (RematPartitioner, (self.config, self.parameter_indices, self.num_graph_inputs,
                                   None, (), self.topology))

    def __call__(self, gm, joint_inputs, **kwargs):
        kwargs.pop("compiler", None)
        return self._partition_fn(gm, joint_inputs, **kwargs)

    def uuid(self) -> str:
        """The FX-graph cache key of this partitioner: stable across processes, so the same
        sources, config, parameter layout and process-group topology (groups by name and
        ranks, with their replicate and secondary groups) give the same key (and a cache
        hit), and another layout a miss."""
        topology = "-" if self.topology is None else self.topology.key()
        return (f"deepcompile_remat:{_source_digest()}:{self.config!r}:{self.parameter_indices}:"
                f"{self.num_graph_inputs}:{topology}")


def eager_graph_compiler() -> Callable:
    """Runs an FX graph as it is, with the boxed calling convention: the generated code clears
    its argument list, so inputs (saved activations, gathered weights) die at their last use
    rather than living for the whole call."""
    try:
        from torch._dynamo.backends.debugging import boxed_nop

        return boxed_nop
    except ImportError:  # older torch: same graphs, inputs held for the call
        from functorch.compile import make_boxed_func

        return lambda gm, _example_inputs: make_boxed_func(gm.forward)


def _eager_backend(config: RematConfig, on_partition: Optional[Callable] = None) -> Callable:
    from torch._dynamo.backends.common import aot_autograd

    boxed_nop = eager_graph_compiler()

    def compile_fn(gm: torch.fx.GraphModule, example_inputs):
        partition = make_partition_fn(config, parameter_indices=_parameters(config, example_inputs),
                                      num_graph_inputs=len(example_inputs),
                                      topology=topology_of(gm), fuses_pointwise=False)
        return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                            partition_fn=_observed(partition, on_partition, example_inputs))(
            gm, example_inputs)

    return compile_fn


def _inductor_backend(config: RematConfig, on_partition: Optional[Callable] = None) -> Callable:
    from torch._inductor.compile_fx import compile_fx

    from deepcompile_remat.zero3 import collective_order

    collective_order.install()  # our collectives in the graph's order on every rank

    def compile_fn(gm: torch.fx.GraphModule, example_inputs):
        if not config.enabled and on_partition is None:  # off: stock inductor
            return compile_fx(gm, example_inputs)
        # Off but observed: torch's min-cut behind the hook, so on_partition sees its graphs.
        topology = topology_of(gm)
        partitioner = RematPartitioner(config, _parameters(config, example_inputs),
                                       len(example_inputs), on_partition, example_inputs,
                                       topology)
        with torch._inductor.config.patch(custom_partitioner_fn=partitioner):
            if not config.enabled:
                return compile_fx(gm, example_inputs)
            return _compiled_with_the_jobs_cut(compile_fx, gm, example_inputs,
                                               partitioner, config.keep_reports,
                                               topology.spans_ranks())

    return compile_fn


def _compiled_with_the_jobs_cut(compile_fx: Callable, gm: torch.fx.GraphModule,
                                example_inputs, partitioner: RematPartitioner, keep: int,
                                spans_ranks: bool):
    """compile_fx(gm, example_inputs), its reports kept beside torch's caches; where torch's
    AOTAutograd cache served a cut this job's ranks did not agree on (planning/agreement.py),
    compiled again without the caches: nothing of the served compile has run."""
    vet = functools.partial(agreement.served_cuts_agree, spans_ranks=spans_ranks)
    with report_cache.surviving_cache_hits(partitioner.uuid(), gm, example_inputs, keep,
                                           vet) as served:
        compiled = compile_fx(gm, example_inputs)
    if not served.refused:
        return compiled
    # Not enable_autograd_cache: TORCHINDUCTOR_AUTOGRAD_CACHE=1 overrides a patch of it.
    hits = report_cache.autograd_cache_hits()
    with torch.compiler.config.patch(force_disable_caches=True):
        compiled = compile_fx(gm, example_inputs)
    if report_cache.autograd_cache_hits() > hits:
        raise RuntimeError(
            "deepcompile_remat: a compile served from torch's AOTAutograd cache runs a cut the "
            "other ranks did not agree on, and compiling it again was served from the cache "
            "too (TORCHINDUCTOR_FORCE_DISABLE_CACHES=0?). Clear the cache folder "
            "(TORCHINDUCTOR_CACHE_DIR) or turn that cache off.")
    return compiled


def compile(model: torch.nn.Module, config: Optional[RematConfig] = None,  # noqa: A001
            kind: Optional[str] = None) -> torch.nn.Module:
    """`model` compiled with backend(kind, config) the way config.compile_scope says (the
    DeepSpeed block's default, zero3/layers.py): "auto" and "layers" compile each repeated
    layer on its own, the rest of a zero3.shard()ed model one eager unit, and return `model`
    itself; "model" (and "auto" where the model has no nn.ModuleList of two or more blocks of
    one class) returns torch.compile(model, backend=...). "layers" on a model without such
    layers raises ValueError (zero3.layers.layers_to_compile, as the takeover decides)."""
    from deepcompile_remat.zero3.layers import compile_by_layer, layers_to_compile

    config = _checked_config(config)
    compiled = backend(kind, config)
    if not layers_to_compile(model, config.compile_scope, "RematConfig.compile_scope"):
        return torch.compile(model, backend=compiled)
    compile_by_layer(model, compiled)
    return model


def backend(kind: Optional[str] = None, config: Optional[RematConfig] = None, *,
            on_partition: Optional[Callable] = None) -> Callable:
    """A torch.compile backend of the given kind ("eager" or "inductor"). kind=None: the
    config's (config.backend_kind: "inductor" unless config.backend says otherwise); a kind
    that contradicts a config.backend that is set is an error. config=None means RematConfig()
    (on, defaults); RematConfig(enabled=False) compiles with torch's partitioner.
    on_partition(fw_module, bw_module, example_inputs): see the module docstring."""
    config = _checked_config(config)
    if kind is not None:
        if config.backend is not None and kind != config.backend:
            raise ValueError(f"backend kind {kind!r} contradicts the config's backend "
                             f"{config.backend!r}; pass one of them, or the same kind")
        # The config's validator checks the kind; the config itself goes on unchanged, so the
        # partitioner's cache key (RematPartitioner.uuid) is the same with or without `kind`.
        kind = dataclasses.replace(config, backend=kind).backend_kind
    else:
        kind = config.backend_kind
    if on_partition is not None and not callable(on_partition):
        raise TypeError("on_partition must be callable")
    fn = (_eager_backend if kind == "eager" else _inductor_backend)(config, on_partition)
    fn.__name__ = f"deepcompile_remat_{kind}"
    return fn
