"""The collectives of one training step, read from the graphs the runtime compiles.

    phases = trace_phases(hf_config, world=64, param_dtype=None)   # phase -> PhaseBytes

One process stands in for rank 0 of a `world`-rank job: torch's fake process group (its
collectives do nothing), the transformers model built on the meta device (no parameter, gather
or activation is ever allocated), sharded by zero3.shard, compiled with our eager backend, and
one forward+backward run on meta tensors (the dcr ops' fake kernels run there, never a
collective). The partitioned forward and backward graphs are what a real rank would run
(the same cut on every rank), so their dcr:: collectives are the step's: which weights the
forward gathers, which the backward re-gathers (the ZeRO-3 marking's recomputes, after the
re-gather schedule and buckets), and every gradient reduce-scatter, with dtypes and padded
sizes.

A whole 7B-shaped Llama (32 layers) traces in about 40 s of CPU. For deeper models,
extrapolate=True traces 1 and 2 layers only: the layers of a transformers decoder are
identical, so the bytes of each phase are an affine function of the layer count and the
extrapolation is exact (bytes add across buckets; the number of collectives is extrapolated
the same way, which bucketing can make off by a few).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Optional

import torch
import torch.fx as fx

PHASES = ("forward gathers", "backward re-gathers", "gradient reduce-scatters",
          "replica all-reduces")

_GATHERS = ("allgather_cast", "allgather_cast_start", "allgather_cast_bucket")
_REDUCE_SCATTERS = ("reduce_scatter_grad", "reduce_scatter_grad_bucket")
_REPLICA_ALL_REDUCES = ("allreduce_replicas",)  # hybrid sharding's, after each reduce-scatter
# The second half of a start: no bytes of its own; a secondary shard (hpZ): a local copy.
_NOT_COLLECTIVES = ("allgather_cast_wait", "secondary_shard")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a partitioned graph: its phase (PHASES), the bytes of the buffer a
    ring moves (the full padded weight of a gather, the full gradient of a reduce-scatter),
    and the number of ranks it runs over."""
    phase: str
    buffer_bytes: int
    group_size: int


@dataclasses.dataclass(frozen=True)
class PhaseBytes:
    """One phase of a step: total buffer bytes and number of collectives, and the size of
    the group they run over."""
    phase: str
    buffer_bytes: int
    collectives: int
    group_size: int


def _bytes_of(val) -> int:
    vals = val if isinstance(val, (list, tuple)) else [val]
    return sum(v.numel() * v.element_size() for v in vals)


def collectives_of(fw: fx.GraphModule, bw: fx.GraphModule) -> list[Collective]:
    """The dcr:: collectives of a partitioned pair, in graph order. Any other collective op
    (dcr:: or torch's functional collectives) is an error: this count must not miss one."""
    out = []
    for graph_tag, gm in (("fw", fw), ("bw", bw)):
        for node in gm.graph.nodes:
            target = node.target
            if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
                continue
            if target.namespace not in ("dcr", "_c10d_functional", "c10d_functional"):
                continue
            name = target._opname
            if name in _NOT_COLLECTIVES:
                continue
            if name in _GATHERS:
                phase = "forward gathers" if graph_tag == "fw" else "backward re-gathers"
                size = _bytes_of(node.meta["val"])
            elif name in _REDUCE_SCATTERS:
                # the full gradients in the dtype they are reduced in: world x this rank's shards
                phase = "gradient reduce-scatters"
                size = _bytes_of(node.meta["val"]) * int(node.args[1])
            elif name in _REPLICA_ALL_REDUCES:
                phase = "replica all-reduces"
                grads = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
                size = sum(_bytes_of(g.meta["val"]) for g in grads)
            else:
                raise ValueError(f"traffic: the {graph_tag} graph has a collective this count does "
                                 f"not know: {target} (node {node.name}); teach "
                                 f"dcr_bench/traffic/trace.py its bytes")
            out.append(Collective(phase, size, int(node.args[1])))
    return out


def with_layers(hf_config, layers: int):
    """A copy of a transformers config with `layers` decoder layers (per-layer lists such as
    layer_types cut or repeated to match)."""
    cfg = copy.deepcopy(hf_config)
    cfg.num_hidden_layers = layers
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, list) and types:
        cfg.layer_types = [types[i % len(types)] for i in range(layers)]
    return cfg


def meta_model(hf_config):
    """The causal LM of a transformers config on the meta device, in train mode (no memory)."""
    import transformers

    transformers.logging.set_verbosity_error()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return model.train()


def hybrid_groups(world: int, replicas: int):
    """(shard group, replicate group) of rank 0 when `world` ranks are `replicas` replicas of
    world / replicas shards, numbered replica by replica (a replica per node: the shard group
    is a node). Every rank's groups are created, as torch.distributed requires."""
    import torch.distributed as dist

    size = world // replicas
    shard_groups = [dist.new_group(list(range(i * size, (i + 1) * size))) for i in range(replicas)]
    replicate_groups = [dist.new_group(list(range(i, world, size))) for i in range(size)]
    return shard_groups[0], replicate_groups[0]


@contextlib.contextmanager
def fake_world(world: int):
    """torch's fake process group of `world` ranks in this process (rank 0), for the block."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("traffic: torch.distributed is already initialized in this process; "
                           "the trace needs its own fake process group (run it in a fresh "
                           "process)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def secondary_groups(world: int, size: int):
    """Rank 0's secondary group when `world` ranks re-gather within blocks of `size`
    consecutive ranks (its node: zero3.shard(secondary_group=), ZeRO++'s hpZ); every block is
    created, as every rank of a real job creates them all."""
    import torch.distributed as dist

    return [dist.new_group(list(range(i, i + size))) for i in range(0, world, size)][0]


def trace_collectives(hf_config, *, world: int, param_dtype: Optional[torch.dtype] = None,
                      remat=None, replicas: int = 1, secondary: int = 1,
                      seq: int = 8) -> list[Collective]:
    """The collectives of one step of `hf_config`'s model sharded over `world` ranks (see the
    module docstring), or with replicas > 1 hybrid-sharded as zero3.shard does it: over
    world / replicas ranks, replicated `replicas` times (hybrid_groups); secondary > 1: the
    backward re-gathers within blocks of that many ranks (secondary_groups); remat: the
    RematConfig to compile with (default RematConfig())."""
    import deepcompile_remat as dcr
    from deepcompile_remat import zero3

    remat = remat if remat is not None else dcr.RematConfig()
    graphs = []
    torch._dynamo.reset()
    patches = (torch._functorch.config.patch(enable_autograd_cache=False),
               torch._inductor.config.patch(fx_graph_cache=False))
    with fake_world(world), patches[0], patches[1]:
        shard_group, replicate_group = (None, None) if replicas == 1 else \
            hybrid_groups(world, replicas)
        secondary_group = None if secondary == 1 else secondary_groups(world, secondary)
        model = zero3.shard(meta_model(hf_config), shard_group, replicate_group=replicate_group,
                            secondary_group=secondary_group, param_dtype=param_dtype)
        compiled = torch.compile(model, backend=dcr.backend(
            "eager", remat, on_partition=lambda fw, bw, _inputs: graphs.append((fw, bw))))
        ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
        compiled(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    torch._dynamo.reset()
    return [c for fw, bw in graphs for c in collectives_of(fw, bw)]


def phase_totals(collectives: list[Collective]) -> dict[str, PhaseBytes]:
    """phase -> PhaseBytes over `collectives` (phases with none are left out). Every
    collective of a phase must run over the same group size."""
    totals: dict[str, PhaseBytes] = {}
    for c in collectives:
        prev = totals.get(c.phase, PhaseBytes(c.phase, 0, 0, c.group_size))
        if prev.group_size != c.group_size:
            raise ValueError(f"traffic: {c.phase} run over groups of {prev.group_size} and "
                             f"{c.group_size} ranks")
        totals[c.phase] = PhaseBytes(c.phase, prev.buffer_bytes + c.buffer_bytes,
                                     prev.collectives + 1, c.group_size)
    return totals


def extrapolate_layers(one: dict[str, PhaseBytes], two: dict[str, PhaseBytes],
                layers: int) -> dict[str, PhaseBytes]:
    """The phases at `layers` layers from traces at 1 and 2 layers: one + (layers - 1) x the
    difference (exact for bytes: the layers are identical)."""
    out = {}
    for phase in sorted(set(one) | set(two), key=PHASES.index):
        a = one.get(phase) or dataclasses.replace(two[phase], buffer_bytes=0, collectives=0)
        b = two.get(phase) or dataclasses.replace(a, buffer_bytes=0, collectives=0)
        out[phase] = PhaseBytes(phase, a.buffer_bytes + (layers - 1) * (b.buffer_bytes - a.buffer_bytes),
                                a.collectives + (layers - 1) * (b.collectives - a.collectives),
                                b.group_size)
    return out


def trace_phases(hf_config, *, world: int, param_dtype: Optional[torch.dtype] = None,
                 remat=None, replicas: int = 1, secondary: int = 1, extrapolate: bool = False
                 ) -> dict[str, PhaseBytes]:
    """phase -> PhaseBytes of one step of hf_config's model (all its layers), sharded over
    `world` ranks (hybrid with replicas > 1: trace_collectives): traced whole, or with
    extrapolate=True traced at 1 and 2 layers and extrapolated (see the module docstring)."""
    kw = dict(world=world, param_dtype=param_dtype, remat=remat, replicas=replicas,
              secondary=secondary)
    if not extrapolate:
        return phase_totals(trace_collectives(hf_config, **kw))
    one = phase_totals(trace_collectives(with_layers(hf_config, 1), **kw))
    two = phase_totals(trace_collectives(with_layers(hf_config, 2), **kw))
    return extrapolate_layers(one, two, hf_config.num_hidden_layers)
