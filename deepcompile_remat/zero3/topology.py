"""The process-group layout a compiled graph runs on: explicit, hashable, by ranks.

    topology = topology_of(gm)     # the shard groups gm's dcr ops name, with their partners
    topology.secondary_of(name)    # (k, secondary group name) or None
    topology.key()                 # one line: part of the compile-cache key

Graphs carry process groups by name (custom_ops: a group_name string argument), and names are
handed out by torch in creation order: the same name can mean other ranks in another job. What
the runtime's passes read about a group (its replicate group, its secondary group) lives in
custom_ops' tables, set by zero3.shard. This module reads those tables once per compile into a
frozen value, so the passes read the value (not the tables) and the cache key holds it: a warm
cache never serves graphs made for another layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.fx as fx

from deepcompile_remat.fx_values import OP_NAMESPACE
from deepcompile_remat.zero3 import custom_ops


@dataclass(frozen=True, slots=True)
class GroupRef:
    """A process group as a graph names it, and the global ranks it holds."""
    name: str
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ShardGroup:
    """A group parameters are sharded over, and the groups the runtime pairs with it."""
    group: GroupRef
    replicate: Optional[GroupRef] = None   # hybrid sharding: the gradient mean's second group
    secondary: Optional[GroupRef] = None   # node-local re-gathers (hpZ)


@dataclass(frozen=True, slots=True)
class Topology:
    """The layout one compiled graph runs on (module docstring). world_size: the default
    group's size (0 without torch.distributed)."""
    world_size: int
    shard_groups: tuple[ShardGroup, ...] = ()

    def secondary_of(self, group_name: str) -> Optional[tuple[int, str]]:
        """(k, name) of the secondary group of shard group `group_name`, or None."""
        for sg in self.shard_groups:
            if sg.group.name == group_name and sg.secondary is not None:
                return len(sg.secondary.ranks), sg.secondary.name
        return None

    def spans_ranks(self) -> bool:
        """Some group the graphs' collectives run on holds more than one rank."""
        return any(g is not None and len(g.ranks) > 1 for sg in self.shard_groups
                   for g in (sg.group, sg.replicate, sg.secondary))

    def shape(self) -> str:
        """The layout by group sizes only: the same on every rank of a job, where key() names
        this rank's own replicate and secondary groups (planning/agreement.py's key part)."""
        return self._line(lambda g: "0" if g is None else str(len(g.ranks)))

    def key(self) -> str:
        """One line naming every group by name and ranks (the compile-cache key's part)."""
        return self._line(lambda g: "-" if g is None else f"{g.name}{list(g.ranks)}")

    def _line(self, describe: Callable[[Optional[GroupRef]], str]) -> str:
        groups = ";".join(f"{describe(sg.group)}/r:{describe(sg.replicate)}"
                          f"/s:{describe(sg.secondary)}" for sg in self.shard_groups)
        return f"world={self.world_size};{groups}"


NO_TOPOLOGY = Topology(world_size=0)


def _overload(target) -> Optional[torch._ops.OpOverload]:
    """A dcr op's overload: Dynamo's graphs call the packet (torch.ops.dcr.allgather_cast),
    AOTAutograd's the overload (.default)."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = getattr(target, "default", None)
    if isinstance(target, torch._ops.OpOverload) and target.namespace == OP_NAMESPACE:
        return target
    return None


def group_names_in(gm: fx.GraphModule) -> list[str]:
    """The group names the dcr ops of `gm` pass (their `group_name` argument), sorted; in
    nested graphs too (an activation-checkpoint region is a subgraph Dynamo hands over as a
    submodule of `gm`, and its gathers are the layer's)."""
    names = set()
    graphs = [m.graph for m in gm.modules() if isinstance(m, fx.GraphModule)]
    for node in (n for graph in graphs for n in graph.nodes):
        op = _overload(node.target) if node.op == "call_function" else None
        for i, arg in enumerate(op._schema.arguments if op is not None else ()):
            if arg.name != "group_name":
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get("group_name")
            if isinstance(value, str):
                names.add(value)
    return sorted(names)


def _ref(group) -> Optional[GroupRef]:
    import torch.distributed as dist

    if group is None:
        return None
    return GroupRef(group.group_name, tuple(dist.get_process_group_ranks(group)))


def topology_of(gm: fx.GraphModule, names: Iterable[str] = ()) -> Topology:
    """The Topology of the groups `gm`'s dcr ops name (and `names`), read from the tables
    zero3.shard keeps. Without torch.distributed: NO_TOPOLOGY."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return NO_TOPOLOGY
    groups = []
    for name in sorted(set(group_names_in(gm)) | set(names)):
        group = custom_ops.resolve_group(name)
        groups.append(ShardGroup(_ref(group), _ref(custom_ops.replicate_group_of(group)),
                                 _ref(custom_ops.secondary_group_of(group))))
    return Topology(dist.get_world_size(), tuple(groups))

