"""What one partition keeps for the backward, and what the memory simulator predicts for it.

Read from the forward and backward FX graphs right after the partitioner returns them (see
``backend(..., on_partition=...)``), before any compiler rewrites them:

- saved values: the backward's placeholders that are neither tangents nor parameter shards
  (the shards live anyway), each storage once (a saved view keeps its whole base alive);
- of those, the *weight* bytes: values computed from parameter shards alone (a gathered weight,
  its views, its bf16 copy): what ZeRO-3 loses when the partitioner saves them;
- activation bytes per transformer block (``blocks.<i>`` in the nodes' module stacks; a node
  without one takes the latest block among its inputs);
- the simulated peaks of the forward and of the backward (csrc/memsim, in FX order),
  relative to the step's start: the forward's inputs pre-exist the step; of the backward's,
  only the shards do;
- bytes moved by the gathers the schedule made asynchronous (functional-collective start/wait
  pairs, which the ops' own counter does not see).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx

from deepcompile_remat.backends import parameter_indices_of
from deepcompile_remat.fx_values import storage_root, value_bytes
from deepcompile_remat.partition.fx_export import is_tangent

_BLOCK = re.compile(r"\b(?:blocks|layers|h)[._](\d+)\b")  # GPT, Llama/Qwen2, GPT2


@dataclass
class PartitionStats:
    """What one partition (or several, combined) saves for the backward, split into weights and
    activations, and the simulated forward and backward peaks of its graphs."""
    saved_values: int = 0
    saved_bytes: float = 0.0
    saved_weight_bytes: float = 0.0
    saved_activation_bytes: float = 0.0
    activation_bytes_per_block: dict = field(default_factory=dict)  # block index -> bytes
    predicted_fw_bytes: float = 0.0  # simulated peak of the forward graph(s) above its inputs
    predicted_bw_bytes: float = 0.0  # ... of the backward, above the parameters

    @property
    def predicted_peak_bytes(self) -> float:
        """The larger of the predicted forward and backward peaks."""
        return max(self.predicted_fw_bytes, self.predicted_bw_bytes)

    def as_dict(self) -> dict:
        """The stats as a JSON-ready dict (block indices as string keys, in order)."""
        return {"saved_values": self.saved_values, "saved_bytes": self.saved_bytes,
                "saved_weight_bytes": self.saved_weight_bytes,
                "saved_activation_bytes": self.saved_activation_bytes,
                "activation_bytes_per_block": {str(k): v for k, v in
                                               sorted(self.activation_bytes_per_block.items())},
                "predicted_fw_bytes": self.predicted_fw_bytes,
                "predicted_bw_bytes": self.predicted_bw_bytes,
                "predicted_peak_bytes": self.predicted_peak_bytes}


def combine(parts: Sequence[PartitionStats]) -> PartitionStats:
    """Several graphs (graph breaks) in one step: saved bytes add up; the graphs run one after
    another, so the predicted peak is at least the largest one's (a lower bound)."""
    out = PartitionStats()
    for p in parts:
        out.saved_values += p.saved_values
        out.saved_bytes += p.saved_bytes
        out.saved_weight_bytes += p.saved_weight_bytes
        out.saved_activation_bytes += p.saved_activation_bytes
        for k, v in p.activation_bytes_per_block.items():
            out.activation_bytes_per_block[k] = out.activation_bytes_per_block.get(k, 0.0) + v
        out.predicted_fw_bytes = max(out.predicted_fw_bytes, p.predicted_fw_bytes)
        out.predicted_bw_bytes = max(out.predicted_bw_bytes, p.predicted_bw_bytes)
    return out


def _value_bytes(node: fx.Node) -> float:
    return float(value_bytes(node.meta.get("val")))


def parameter_names(fw: fx.GraphModule, example_inputs: Sequence[Any]) -> set:
    """Names of the forward's placeholders that are parameters (the backend's nn.Parameter
    inputs; AOTAutograd names primal i ``primals_{i+1}``)."""
    placeholders = [n.name for n in fw.graph.find_nodes(op="placeholder")]
    return {f"primals_{i + 1}" for i in parameter_indices_of(example_inputs)} & set(placeholders)


def _weight_derived(fw: fx.GraphModule, params: set) -> set:
    """Nodes computed from parameter shards alone."""
    out = set()
    for n in fw.graph.nodes:
        if n.op == "placeholder":
            if n.name in params:
                out.add(n)
        elif n.op == "call_function":
            inputs = n.all_input_nodes
            if inputs and all(i in out for i in inputs):
                out.add(n)
    return out


def _block_of(node: fx.Node, memo: dict) -> Optional[int]:
    if node in memo:
        return memo[node]
    memo[node] = None  # cycles cannot happen in a DAG, but guard the recursion anyway
    stack = node.meta.get("nn_module_stack") or {}
    found = None
    for path, _ in stack.values():
        m = _BLOCK.search(str(path))
        if m:
            found = int(m.group(1))
    if found is None:
        blocks = [b for b in (_block_of(i, memo) for i in node.all_input_nodes) if b is not None]
        found = max(blocks) if blocks else None
    memo[node] = found
    return found


def _predicted(gm: fx.GraphModule, persistent: set, preexisting: set) -> float:
    """Simulated peak of `gm` as the eager backend runs it (simulate.graph_peak without
    fusion; ops' scratch counted) minus the bytes of the inputs in `preexisting` (alive before
    the step)."""
    from deepcompile_remat.partition.simulate import graph_peak

    peak, _ = graph_peak(gm, persistent, fuses_pointwise=False)
    before = sum(value_bytes(n.meta.get("val")) for n in gm.graph.find_nodes(op="placeholder")
                 if n.name in preexisting)
    return float(peak - before)


def analyze(fw: fx.GraphModule, bw: fx.GraphModule,
            example_inputs: Sequence[Any]) -> PartitionStats:
    """The stats of one partition: what the backward graph `bw` receives from the forward `fw`
    (tangents and parameters excluded), split into weight-derived values and activations per
    block, plus both graphs' simulated peaks."""
    params = parameter_names(fw, example_inputs)
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    weights = _weight_derived(fw, params)
    stats = PartitionStats()
    memo: dict = {}
    roots = {}
    for p in bw.graph.find_nodes(op="placeholder"):
        if is_tangent(p) or p.name in params:
            continue
        if not isinstance(p.meta.get("val"), torch.Tensor):
            continue
        stats.saved_values += 1
        node = fw_nodes.get(p.name)
        root = storage_root(node) if node is not None else p
        roots.setdefault(root, p)
    for root in roots:
        nbytes = _value_bytes(root)
        if root.op == "placeholder" and root.name in params:
            continue  # a view of a shard: the shard lives anyway
        stats.saved_bytes += nbytes
        if root in weights:
            stats.saved_weight_bytes += nbytes
        else:
            stats.saved_activation_bytes += nbytes
            block = _block_of(root, memo)
            if block is not None:
                stats.activation_bytes_per_block[block] = (
                    stats.activation_bytes_per_block.get(block, 0.0) + nbytes)
    fw_inputs = {n.name for n in fw.graph.find_nodes(op="placeholder")}
    stats.predicted_fw_bytes = _predicted(fw, params, fw_inputs)
    stats.predicted_bw_bytes = _predicted(bw, params, params)
    return stats


class PartitionRecorder:
    """An on_partition observer: analyzes every partition it sees, in order."""

    def __init__(self) -> None:
        self.partitions: list[PartitionStats] = []

    def __call__(self, fw, bw, example_inputs) -> None:
        self.partitions.append(analyze(fw, bw, example_inputs))

    def stats(self) -> PartitionStats:
        """Every partition seen so far, combined as one step runs them."""
        return combine(self.partitions)
