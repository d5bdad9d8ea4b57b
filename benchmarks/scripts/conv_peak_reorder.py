"""A basic-block ResNet under CPU bf16 autocast: ours' step peak against torch's, with
inductor's peak-memory reordering on (its default) and off.

    python3 benchmarks/scripts/conv_peak_reorder.py on 64
    python3 benchmarks/scripts/conv_peak_reorder.py off 64

cut-quality's "resnet-basic" (HF ResNetForImageClassification, layer_type="basic", embedding
32, hidden [32, 64, 128, 256], one block per stage, batch 4) at <side>x<side> images (a
multiple of 64, default 64), one process, no ZeRO-3, inductor; cut-quality's side-by-side
measurement (cut_quality.measure_pair). "off" sets
torch._inductor.config.reorder_for_peak_memory = False for both partitioners.

What it showed (2026-11-28, torch 2.13.0+cpu), before the cut priced the weights inductor
saves as channels-last copies (partition/layouts.py): ours 9.24 MB against torch's 7.29
(+26.7%) with the reordering on, 7.46 (+2.3%) with it off. Ours saved each conv weight in fp32
to recompute its bf16 cast in the backward, and inductor wrote each saved weight out as an
fp32 channels-last copy; the reordering then moved the recomputed casts to the start of the
backward. After: 7.29 against 7.29 with the reordering on and off. benchmarks/README.md,
"cut-quality".
"""
from __future__ import annotations

import sys

import torch._inductor.config as inductor_config

from dcr_bench.profile import cut_quality


def main(reorder: str, side: int) -> None:
    inductor_config.reorder_for_peak_memory = reorder == "on"
    if side % 64:
        raise SystemExit(f"side must be a multiple of 64, got {side}")
    rows = cut_quality.measure_pair("resnet-basic", "inductor", "bf16", steps=3, rounds=2,
                                    scale=side // 64)
    by = {r["partitioner"]: r for r in rows}
    torch_mb, ours_mb = by["torch"]["peak_bytes"] / 1e6, by["ours"]["peak_bytes"] / 1e6
    print(f"reorder_for_peak_memory {reorder}, {side}x{side}: torch {torch_mb:.2f} MB, "
          f"ours {ours_mb:.2f} MB ({(ours_mb / torch_mb - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "on", int(sys.argv[2]) if len(sys.argv) > 2 else 64)
