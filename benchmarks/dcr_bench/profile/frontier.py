"""`deepcompile-remat frontier`: whole-step peak against step time, over settings of ours and of
the peers, with the Pareto front and the physical floor.

    deepcompile-remat frontier --model llama --layers 4 --hidden 512 --seq 1024
    deepcompile-remat frontier --model qwen2 --seq 1024 --systems ours-inductor fsdp2-block-compiled

One point per system and setting, each a `compare` run of its own (compare.rank_main: same model,
seed, micro-batch and ranks, AdamW, the allocator's absolute peak, median step time):
  ours-inductor           the default cut; memory_budget 0.5 and 0 (partition/budget.py);
                          peak_target 1.0 and 0.85 (partition/planner.py: the fastest plan
                          whose simulated peak is within the ordinary cut's, or 85% of it)
  ours-inductor-layer-buckets   gathers and reduce-scatters grouped by layer (FSDP2's grouping)
  ours-inductor-blocks    the same, each layer compiled on its own (fsdp2-block-compiled's way)
  ours-inductor-blocks-grad-buckets   the same, a layer's fp32 gradients in one reduce-scatter
  fsdp2-block, fsdp2-block-compiled, fsdp2-module   the FSDP2 peers
  deepspeed-lean          stock ZeRO-3 at its least memory
each without and (transformers models) with HF's activation checkpointing on every layer.

The front: the points no other point beats on both peak and time (a tie on one and a win on the
other beats). The floor: what any ZeRO-3 step must hold at its peak, measured on this model:
  at rest          the lowest at-rest total measured (fp32 shards and AdamW's moments)
  gradient shards  this rank's gradient of every parameter (fp32; bf16 under --precision bf16)
  one layer        the largest layer's forward-and-backward working set (activations, their
                   gradients, the layer's temporaries), measured by running that layer alone
                   on the batch it sees in the model, its weights given
  its weights      that layer's weights, gathered in 16 bits
Writes frontier.json, table.txt and frontier.png (peak against step time, front joined, floor
dashed) in --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

from dcr_bench.harness.workload import Workload, add_model_arguments, workload_from_args

NAME = "frontier"
# (label, compare peer, ours_config)
SETTINGS = (
    ("ours-inductor", "ours-inductor", {}),
    ("ours-inductor budget 0.5", "ours-inductor", {"memory_budget": 0.5}),
    ("ours-inductor budget 0", "ours-inductor", {"memory_budget": 0.0}),
    ("ours-inductor peak 1.0", "ours-inductor", {"peak_target": 1.0}),
    ("ours-inductor peak 0.85", "ours-inductor", {"peak_target": 0.85}),
    ("ours-inductor-layer-buckets", "ours-inductor-layer-buckets", {}),
    ("ours-inductor-blocks", "ours-inductor-blocks", {}),
    ("ours-inductor-blocks-grad-buckets", "ours-inductor-blocks-grad-buckets", {}),
    ("fsdp2-block", "fsdp2-block", {}),
    ("fsdp2-block-compiled", "fsdp2-block-compiled", {}),
    ("fsdp2-module", "fsdp2-module", {}),
    ("deepspeed-lean", "deepspeed-lean", {}),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The frontier command's flags: the model, which systems, precision, ranks, steps."""
    from dcr_bench.profile.compare import add_rank_arguments

    add_model_arguments(parser)
    g = parser.add_argument_group("run")
    peers = sorted({peer for _, peer, _ in SETTINGS})
    g.add_argument("--systems", nargs="+", choices=peers, default=peers,
                   help="which systems' points to run (default: all)")
    g.add_argument("--no-checkpointing", action="store_true",
                   help="only the points without HF activation checkpointing")
    g.add_argument("--precision", choices=("autocast", "bf16"), default="autocast")
    g.add_argument("--world", type=int, default=2)
    g.add_argument("--warmup", type=int, default=2)
    g.add_argument("--steps", type=int, default=5)
    g.add_argument("--out", default="frontier-results")
    g.add_argument("--quiet", action="store_true")
    add_rank_arguments(g)


def points(w: Workload, systems, checkpointing: bool = True) -> list:
    """(label, peer, ours_config, workload) per point to run: every setting of `systems`,
    without and, for a transformers model when `checkpointing`, with HF's checkpointing."""
    modes = [False, True] if (w.is_hf and checkpointing) else [False]
    return [(label + (" +ckpt" if ck else ""), peer, cfg,
             dataclasses.replace(w, checkpointing=ck))
            for ck in modes for label, peer, cfg in SETTINGS if peer in systems]


def pareto_front(rows: list) -> list:
    """The rows (dicts with "peak" and "step_s") that no other row beats: lower or equal on
    both and lower on one. In order of step time."""
    def beaten(r):
        return any(o["peak"] <= r["peak"] and o["step_s"] <= r["step_s"]
                   and (o["peak"] < r["peak"] or o["step_s"] < r["step_s"]) for o in rows)

    return sorted((r for r in rows if not beaten(r)), key=lambda r: r["step_s"])


def layer_floor(w: Workload, precision: str) -> dict:
    """The largest layer's forward-and-backward working set and its 16-bit weights (bytes),
    measured in this process: the model runs once to capture what the layer receives, then the
    layer alone runs forward and backward on it (weights not trained, so no weight gradients:
    a ZeRO-3 step reduce-scatters those into the shards counted apart)."""
    import contextlib

    import torch

    from dcr_bench.harness import memory
    from dcr_bench.harness.workload import blocks

    model = w.build(precision)
    layer = max(blocks(model), key=lambda b: sum(p.numel() for p in b.parameters()))
    seen = {}

    def grab(_module, args, kwargs):
        seen.setdefault("call", (args, kwargs))

    handle = layer.register_forward_pre_hook(grab, with_kwargs=True)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "autocast"
                else contextlib.nullcontext())
    batch = w.inputs(0)
    with torch.no_grad(), autocast:
        w.loss(model, batch)
    handle.remove()
    args, kwargs = seen["call"]
    for p in layer.parameters():
        p.requires_grad_(False)
    x = args[0].detach().clone().requires_grad_()

    def first(out):
        return out[0] if isinstance(out, (tuple, list)) else out

    with memory.profiled(activities=[torch.profiler.ProfilerActivity.CPU],
                         profile_memory=True) as prof:
        with autocast:
            y = first(layer(x, *args[1:], **kwargs))
        y.float().sum().backward()
    working = memory.peak_over_profile(prof)
    weights = 2 * sum(p.numel() for p in layer.parameters())
    return {"layer_working_set_bytes": working, "layer_weights_16bit_bytes": float(weights),
            "layer": type(layer).__name__}


def run(args: argparse.Namespace) -> int:
    """Peak memory against step time over settings of ours and the peers: the Pareto front."""
    from dcr_bench.harness.ranks import free_port, spawn_for_rows
    from dcr_bench.profile.compare import fold, rank_main, rank_options

    w = workload_from_args(args, NAME)
    todo = points(w, args.systems, not args.no_checkpointing)
    rows = []
    for i, (label, peer, cfg, wl) in enumerate(todo):
        if not args.quiet:
            print(f"[{i + 1}/{len(todo)}] {label}", flush=True)
        opts = {"device": "cpu", "warmup": args.warmup, "steps": args.steps, "progress": False,
                "ours_config": cfg, "log_dir": os.path.abspath(os.path.join(args.out, "logs")),
                **rank_options(args)}
        got = fold(spawn_for_rows(rank_main, args.world, args.world, free_port(), peer,
                                  args.precision, dataclasses.asdict(wl), opts))[0]
        row = {"label": label, "peer": peer, "ours_config": cfg, "checkpointing": wl.checkpointing,
               "why_not": got["why_not"]}
        if got["why_not"] is None:
            row.update(peak=got["step_peak_bytes"], at_rest=got["at_rest_bytes"],
                       step_s=got["step_s"], cpu_s=got["cpu_s"],
                       collectives=got["collectives"], loss=got["step1_losses"][0])
            if "plan_predicted_bytes" in got:  # peak-target mode: the planner's prediction
                row.update(plan_predicted=got["plan_predicted_bytes"],
                           plan_families=got["plan_families"])
        rows.append(row)
    ran = [r for r in rows if r["why_not"] is None]
    params = sum(p.numel() for p in w.build("autocast").parameters())
    floor = layer_floor(w, args.precision)
    grad_bytes = (2 if args.precision == "bf16" else 4) * params / args.world
    at_rest = min((r["at_rest"] for r in ran), default=float("nan"))
    floor.update(at_rest_bytes=at_rest, gradient_shard_bytes=grad_bytes)
    floor["floor_bytes"] = (at_rest + grad_bytes + floor["layer_working_set_bytes"]
                            + floor["layer_weights_16bit_bytes"])
    front = pareto_front(ran)
    for r in ran:
        r["on_front"] = r in front
    os.makedirs(args.out, exist_ok=True)
    meta = {"workload": dataclasses.asdict(w), "parameters": params, "world": args.world,
            "precision": args.precision, "steps": args.steps, "warmup": args.warmup}
    with open(os.path.join(args.out, "frontier.json"), "w") as f:
        json.dump({"meta": meta, "floor": floor, "rows": rows}, f, indent=1)
    text = render(w.describe(params), args, rows, floor)
    with open(os.path.join(args.out, "table.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    png = plot(ran, floor, os.path.join(args.out, "frontier.png"),
               f"{w.describe(params)}; {args.precision}; {args.world} gloo ranks")
    print("\nwrote " + ", ".join(os.path.join(args.out, n) for n in ("frontier.json", "table.txt"))
          + (f", {png}" if png else ""))
    return 0


def render(title: str, args: argparse.Namespace, rows: list, floor: dict) -> str:
    """The points as a table (front marked *), then the floor and its parts."""
    mb = 2 ** 20
    lines = [f"{title}; {args.precision}; {args.world} gloo ranks; whole step with AdamW",
             "MB per rank (largest rank), median step s; *: on the Pareto front", "",
             f"{'':1} {'point':<36} {'peak':>8} {'at rest':>8} {'step s':>7} {'cpu s':>7} "
             f"{'colls':>6}"]
    for r in rows:
        if r["why_not"] is not None:
            lines.append(f"  {r['label']:<36} not run: {r['why_not']}")
            continue
        lines.append(f"{'*' if r['on_front'] else ' '} {r['label']:<36} {r['peak'] / mb:>8.1f} "
                     f"{r['at_rest'] / mb:>8.1f} {r['step_s']:>7.3f} {r['cpu_s']:>7.3f} "
                     f"{r['collectives']:>6.0f}" + (
                         f"  plan {'/'.join(r['plan_families'])}: above rest simulated "
                         f"{r['plan_predicted'] / mb:.1f}, measured "
                         f"{(r['peak'] - r['at_rest']) / mb:.1f}" if "plan_predicted" in r
                         else ""))
    lines += ["", f"floor {floor['floor_bytes'] / mb:.1f} MB = at rest "
              f"{floor['at_rest_bytes'] / mb:.1f} + gradient shards "
              f"{floor['gradient_shard_bytes'] / mb:.1f} + one {floor['layer']}'s forward and "
              f"backward {floor['layer_working_set_bytes'] / mb:.1f} + its 16-bit weights "
              f"{floor['layer_weights_16bit_bytes'] / mb:.1f}"]
    ours = [r for r in rows if r["why_not"] is None and r["peer"].startswith("ours")]
    if ours:
        low = min(ours, key=lambda r: r["peak"])
        lines.append(f"ours' lowest point: {low['label']}, {low['peak'] / mb:.1f} MB, "
                     f"{low['peak'] / floor['floor_bytes'] - 1:+.0%} against the floor")
    return "\n".join(lines)


def plot(rows: list, floor: dict, path: str, title: str):
    """Peak against step time, one marker per point (ours filled, peers hollow), the front
    joined, the floor dashed. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    mb = 2 ** 20
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for r in rows:
        ours = r["peer"].startswith("ours")
        ax.scatter(r["step_s"], r["peak"] / mb, s=40, marker="o" if ours else "s",
                   facecolors="#d46a6a" if ours else "none", edgecolors="#333333")
        ax.annotate(r["label"], (r["step_s"], r["peak"] / mb), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    front = sorted((r for r in rows if r.get("on_front")), key=lambda r: r["step_s"])
    ax.plot([r["step_s"] for r in front], [r["peak"] / mb for r in front], color="#d46a6a",
            lw=1, label="Pareto front")
    ax.axhline(floor["floor_bytes"] / mb, color="#555555", ls="--", lw=1,
               label="physical floor")
    ax.set_xlabel("median step time (s)")
    ax.set_ylabel("whole-step peak (MB per rank)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
