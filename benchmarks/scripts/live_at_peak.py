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

from dcr_bench.harness.memory import live_at_peak, profiled
from dcr_bench.profile import cut_quality


def main(arch: str, partitioner: str, precision: str) -> None:
    step, _ = cut_quality._compiled_and_warm(arch, partitioner, "inductor", precision, 1, None,
                                             "cpu", True)
    with profiled(profile_memory=True) as prof:
        step()
    print(live_at_peak(prof, "cpu", f"{arch} {partitioner} {precision}"), end="")


if __name__ == "__main__":
    main(*(sys.argv[1:4] if len(sys.argv) >= 4 else ("resnet-basic", "ours", "fp32")))
