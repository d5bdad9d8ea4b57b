"""What is alive at a cut-quality step's peak: the allocator's live blocks at the highest point
of one profiled step, grouped by the ops that allocated them.

    python3 benchmarks/scripts/live_at_peak.py resnet-basic ours fp32

<arch> is a cut-quality architecture, <partitioner> "ours" or "torch", <precision> "fp32" or
"bf16"; inductor, one process, no ZeRO-3 (cut_quality.compiled_step). It prints the peak above
the step's start, the op stack at the peak, the live bytes per allocating op stack, and the
largest blocks. This is how the two conv-net findings in benchmarks/README.md were traced:
inductor's channels-last weight copies (allocated in the forward, alive in the backward) and
oneDNN's convolution_backward temporaries (resnet-basic fp32, 4.85 MB at the peak).
"""
from __future__ import annotations

import sys
from collections import defaultdict

from dcr_bench.harness.memory import allocation_nodes, event_tree, profiled
from dcr_bench.profile import cut_quality


def _stack(node, depth: int = 3) -> str:
    names, q = [], node.parent
    while q is not None and len(names) < depth:
        names.append(q.name[:50])
        q = q.parent
    return " < ".join(names)


def main(arch: str, partitioner: str, precision: str) -> None:
    step, _ = cut_quality._compiled_and_warm(arch, partitioner, "inductor", precision, 1, None,
                                             "cpu", True)
    with profiled(profile_memory=True) as prof:
        step()
    events = allocation_nodes(event_tree(prof), "cpu")
    start = events[0].typed[1].total_allocated - events[0].typed[1].alloc_size
    live, peak, at_peak, where = {}, -1.0, {}, None
    for n in events:
        a = n.typed[1]
        if a.alloc_size > 0:
            live[a.ptr] = (a.alloc_size, n)
        else:
            live.pop(a.ptr, None)
        if a.total_allocated - start > peak:
            peak, at_peak, where = a.total_allocated - start, dict(live), n
    print(f"{arch} {partitioner} {precision}: peak {peak / 1e6:.2f} MB above the step's start")
    print("at:", _stack(where, 5))
    by_stack, count = defaultdict(float), defaultdict(int)
    for size, n in at_peak.values():
        by_stack[_stack(n)] += size
        count[_stack(n)] += 1
    for stack, size in sorted(by_stack.items(), key=lambda kv: -kv[1])[:12]:
        print(f"{size / 1e6:8.3f} MB {count[stack]:4d} blocks  {stack}")
    print("largest blocks:")
    for size, n in sorted(at_peak.values(), key=lambda sn: -sn[0])[:12]:
        print(f"{size / 1e3:9.1f} KB  {_stack(n)}")


if __name__ == "__main__":
    main(*(sys.argv[1:4] if len(sys.argv) >= 4 else ("resnet-basic", "ours", "fp32")))
