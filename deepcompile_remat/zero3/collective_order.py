"""Keeps the ZeRO-3 collectives of an inductor-compiled graph in the graph's order.

Every rank must issue its collectives in one order. The runtime's schedule fixes one in the FX
graph (schedule.py), but inductor's scheduler then reorders nodes for peak memory
(config.reorder_for_peak_memory): it picks among topological orders by estimates that depend on
tensor sizes, and our collectives depend on each other only through data. So two ranks that
compile at different sizes (one rank's first batch longer than the other's, as with per-rank
padding, or the size hints of a dynamic graph) could issue them in different orders: gloo
aborts ("Received data size doesn't match"), NCCL hangs, and two buckets of one size would
swap their data silently. This pass chains every dcr:: op to the one before it with a fake
dependency (how torch orders its own collectives: comms.decide_global_ordering_of_comms), so
whatever order inductor picks keeps theirs.

It is inductor's post-fusion scheduler pass, set process-wide by install() (a backward may be
compiled lazily, after any config.patch around the forward's compile has exited), composed with
a pass the user set before, and it changes no graph without dcr ops. Its uuid keeps inductor's
FX-graph cache on (None, as torch asks, where the pass it wraps has no uuid).
"""
from __future__ import annotations

import hashlib
import logging
from typing import Callable, Optional

from deepcompile_remat.fx_values import OP_NAMESPACE

log = logging.getLogger(__name__)

try:
    from torch._inductor.custom_graph_pass import CustomSchedulerPass as _PassBase
except ImportError:  # a torch without scheduler-pass caching: a plain callable (no FX cache)
    _PassBase = object


def _is_ours(snode) -> bool:
    op = getattr(getattr(snode, "node", None), "op_overload", None)
    return getattr(op, "namespace", None) == OP_NAMESPACE


def _holds_ours(snode) -> bool:
    """Whether a scheduler node (or one fused or grouped into it) runs a dcr:: op."""
    return any(_is_ours(s) for s in snode.get_nodes())


def _fake_dep(buffer: str, mutating: str):
    from torch._inductor.dependencies import WeakDep

    try:  # ordering only: does not extend `buffer`'s lifetime
        return WeakDep(buffer, mutating_buf=mutating, is_fake=True)
    except TypeError:  # older torch: a plain weak dependency (the same order)
        return WeakDep(buffer, mutating_buf=mutating)


def keep_collective_order(nodes: list) -> list:
    """`nodes` (inductor scheduler nodes, in the graph's order) with each node that runs a
    dcr:: op made to depend on the last such node before it; the list itself unchanged."""
    previous = None
    for node in nodes:
        if not _holds_ours(node):
            continue
        names = list(node.get_buffer_names())
        if previous is not None and names:
            for buffer in previous:
                node.add_fake_dep(_fake_dep(buffer, names[0]))
        if names:
            previous = names
    return nodes


class CollectiveOrderPass(_PassBase):
    """keep_collective_order, then the pass it wraps (`then`: the user's, if any)."""

    def __init__(self, then: Optional[Callable] = None):
        self.then = then

    def __call__(self, nodes: list) -> list:
        nodes = keep_collective_order(nodes)
        return self.then(nodes) if self.then is not None else nodes

    def uuid(self) -> Optional[str]:
        """Inductor's cache key of the pass: this file and the wrapped pass's key; None (no
        caching) where the wrapped pass has none."""
        then = None
        if self.then is not None:
            then = self.then.uuid() if hasattr(self.then, "uuid") else None
            if then is None:
                return None  # the wrapped pass cannot be keyed: no caching (torch's rule)
        with open(__file__, "rb") as f:
            return hashlib.sha256(f.read() + repr(then).encode()).hexdigest()


def install() -> None:
    """Makes CollectiveOrderPass inductor's post-fusion pass in this process (idempotent)."""
    from torch._inductor import config

    if not hasattr(config, "_post_fusion_custom_pass"):  # a torch without the hook
        log.warning("deepcompile_remat: this torch has no inductor post-fusion pass hook, so "
                    "the collectives' order across ranks rests on equal sizes on every rank")
        return
    current = config._post_fusion_custom_pass
    if not isinstance(current, CollectiveOrderPass):
        config._post_fusion_custom_pass = CollectiveOrderPass(current)
