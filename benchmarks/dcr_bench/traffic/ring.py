"""Which bytes of a step cross node boundaries, when every collective runs as a ring.

The model: `world` ranks, numbered node by node (node n holds ranks n*G .. n*G+G-1, G the node
size). A collective over a group of k ranks runs as one ring in the group's rank order: rank
g[i] sends to g[i+1 mod k]. An all-gather or a reduce-scatter of a B-byte buffer sends
(k-1)/k x B from every rank (k-1 steps of one B/k chunk); an all-reduce sends twice that
(a reduce-scatter, then an all-gather). A rank's bytes cross a node boundary when its
successor is on another node. NCCL's rings are built the same way (each enters and leaves a
node once; several channels split the buffer among the node's NICs, which changes which NIC
carries the bytes, not how many leave the node), so "leaving each node" is the figure a
node's network links carry, and the mean per rank is that divided by G (one NIC per GPU).

Layouts: where each phase of a step runs.
    zero3   flat ZeRO-3: every gather, re-gather and reduce-scatter over all `world` ranks;
    hpz     ZeRO++'s hpZ (node-local re-gathers): the backward re-gathers read a secondary
            shard held within the node, so they run over the node's G ranks;
    hsdp    hybrid sharding (FSDP2's HSDP): parameters sharded over the G ranks of a node
            and replicated across the N = world / G nodes; gathers and reduce-scatters run
            within the node, then each rank's gradient shard is all-reduced (averaged) over the
            N ranks that hold the same shard, one per node.
"""
from __future__ import annotations

import dataclasses

import numpy as np

LAYOUTS = ("zero3", "hpz", "hsdp")
OP_OF_PHASE = {"forward gathers": "all_gather", "backward re-gathers": "all_gather",
               "gradient reduce-scatters": "reduce_scatter", "replica all-reduces": "all_reduce"}
# layout -> phase -> which groups run it ("world", "node": the ranks of one node, "replica":
# one rank per node, the same position in each)
GROUPS = {
    "zero3": {"forward gathers": "world", "backward re-gathers": "world",
              "gradient reduce-scatters": "world"},
    "hpz": {"forward gathers": "world", "backward re-gathers": "node",
            "gradient reduce-scatters": "world"},
    "hsdp": {"forward gathers": "node", "backward re-gathers": "node",
             "gradient reduce-scatters": "node", "replica all-reduces": "replica"},
}


@dataclasses.dataclass(frozen=True)
class Ranks:
    """`world` ranks in nodes of `node_size`, numbered node by node."""
    world: int
    node_size: int

    def __post_init__(self):
        if self.world < 1 or self.node_size < 1 or self.world % self.node_size:
            raise ValueError(f"traffic: the world ({self.world}) must be a positive multiple of "
                             f"the node size ({self.node_size})")

    @property
    def nodes(self) -> int:
        """How many nodes."""
        return self.world // self.node_size

    def node_of(self, rank: int) -> int:
        """The node `rank` is on."""
        return rank // self.node_size

    def groups(self, kind: str) -> list[list[int]]:
        """The groups of a kind ("world", "node", "replica"), each in ring order."""
        g, n = self.node_size, self.nodes
        if kind == "world":
            return [list(range(self.world))]
        if kind == "node":
            return [list(range(i * g, (i + 1) * g)) for i in range(n)]
        if kind == "replica":
            return [[i + j * g for j in range(n)] for i in range(g)]
        raise ValueError(f"traffic: unknown group kind {kind!r}")


def ring_sends(op: str, buffer_bytes: float, groups: list[list[int]], ranks: Ranks):
    """(sent, crossing): per-rank arrays of the bytes each rank sends when every group runs
    `op` ("all_gather", "reduce_scatter", "all_reduce") on a buffer of `buffer_bytes` as a
    ring, and of those, the bytes whose next hop is on another node."""
    steps = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}[op]
    sent = np.zeros(ranks.world)
    crossing = np.zeros(ranks.world)
    for group in groups:
        k = len(group)
        per_rank = steps * (k - 1) / k * buffer_bytes
        for i, rank in enumerate(group):
            sent[rank] += per_rank
            if ranks.node_of(group[(i + 1) % k]) != ranks.node_of(rank):
                crossing[rank] += per_rank
    return sent, crossing


@dataclasses.dataclass(frozen=True)
class PhaseTraffic:
    """One phase of one layout: bytes per rank per step, all links and crossing a node boundary
    (mean and most over ranks), and the bytes leaving each node (mean over nodes)."""
    layout: str
    phase: str
    group: str  # "world", "node", "replica"
    group_size: int
    collectives: int
    sent_per_rank: float
    crossing_per_rank: float
    crossing_max_rank: float
    leaving_node: float


def phase_traffic(layout: str, phase: str, buffer_bytes: float, collectives: int,
                  group_size: int, ranks: Ranks) -> PhaseTraffic:
    """A phase of `layout` whose collectives move `buffer_bytes` in all, each over groups of
    `group_size` ranks (checked against the layout's groups), run as rings over `ranks`."""
    kind = GROUPS[layout][phase]
    groups = ranks.groups(kind)
    if len(groups[0]) != group_size:
        raise ValueError(f"traffic: {layout}'s {phase} run over {kind} groups of "
                         f"{len(groups[0])} ranks, but the traced collectives ran over "
                         f"{group_size}")
    sent, crossing = ring_sends(OP_OF_PHASE[phase], buffer_bytes, groups, ranks)
    per_node = crossing.reshape(ranks.nodes, ranks.node_size).sum(axis=1)
    return PhaseTraffic(layout, phase, kind, group_size, collectives, float(sent.mean()),
                        float(crossing.mean()), float(crossing.max()), float(per_node.mean()))


def layout_traffic(layout: str, phases: dict, ranks: Ranks) -> list[PhaseTraffic]:
    """Every phase of `layout` from traced phase totals (trace.PhaseBytes by phase): a flat
    trace for zero3, one with the runtime's node-local re-gathers (zero3.shard(
    secondary_group=) over each node) for hpz, a hybrid-sharded one (a replica per node) for
    hsdp, whose replica all-reduces the runtime issues after each reduce-scatter. Each
    phase's traced group size must be the layout's (phase_traffic checks it)."""
    phases = dict(phases)
    out = []
    for phase in GROUPS[layout]:
        p = phases.get(phase)
        if p is None:  # e.g. no backward re-gathers: nothing to move
            out.append(PhaseTraffic(layout, phase, GROUPS[layout][phase], 0, 0, 0.0, 0.0, 0.0,
                                    0.0))
            continue
        out.append(phase_traffic(layout, phase, p.buffer_bytes, p.collectives, p.group_size,
                                 ranks))
    return out
