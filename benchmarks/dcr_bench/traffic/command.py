"""`deepcompile-remat traffic`: bytes per rank per step, and those crossing node boundaries.

    deepcompile-remat traffic                                  # 7B-shaped Llama, 64 = 8 x 8
    deepcompile-remat traffic --world 128 --node-size 8 --precision bf16
    deepcompile-remat traffic --model path/to/config.json --extrapolate
    deepcompile-remat traffic --no-marking      # what the backward moves without the marking

For each layout (ring.py: flat ZeRO-3, ZeRO++'s hpZ node-local re-gathers, hybrid sharding)
and each phase of a step (forward gathers, backward re-gathers, gradient reduce-scatters,
replica all-reduces), the traced figures (trace.py: the collectives of the graphs the runtime
compiles, on meta tensors under torch's fake process group; ring.py: which of their bytes
cross a node boundary) beside the closed form (closed_form.py: from the parameter counts).
The exit status is 1 when any traced figure differs from its closed form.
"""
from __future__ import annotations

import argparse
import json
import math
import time

from dcr_bench.traffic.ring import LAYOUTS

NAME = "traffic"
PRECISIONS = {"fp32": None, "bf16": "bfloat16"}  # --precision -> zero3.shard(param_dtype=)
LLAMA_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                max_position_embeddings=4096)
_FIGURES = ("sent_per_rank", "crossing_per_rank", "crossing_max_rank", "leaving_node")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `traffic` subcommand's options."""
    parser.add_argument("--model", default="llama-7b",
                        help="llama-7b (LlamaConfig with 7B shapes, the default), a transformers "
                             "preset of the harness (llama, qwen2, gpt2: small), or a config.json")
    parser.add_argument("--world", type=int, default=64, help="ranks (default %(default)s)")
    parser.add_argument("--node-size", type=int, default=8,
                        help="ranks per node (default %(default)s)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="fp32: gathers in fp32; bf16: zero3.shard(param_dtype=bf16), "
                             "gathers cast to bf16 (gradients reduce in fp32 either way)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--extrapolate", action="store_true",
                        help="trace 1 and 2 layers and extrapolate (exact for bytes: identical "
                             "layers) instead of tracing every layer")
    parser.add_argument("--no-marking", action="store_true",
                        help="compile with RematConfig(mark_parameter_aliases=False): the "
                             "backward keeps gathered weights instead of re-gathering them")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")


def model_config(spec: str):
    """The transformers config --model names."""
    import transformers

    from dcr_bench.harness.models import hf_config

    if spec == "llama-7b":
        transformers.logging.set_verbosity_error()
        return transformers.LlamaConfig(**LLAMA_7B)
    return hf_config(spec)


def _agree(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)


def measure(hf_config, world: int, node_size: int, precision: str = "fp32",
            layouts=LAYOUTS, extrapolate: bool = False,
            marking: bool = True) -> list[dict]:
    """One row per layout and phase: the traced figures, the closed form's ("formula_..."),
    and whether they agree. Traces in this process (torch.distributed must not be
    initialized here)."""
    import torch

    import deepcompile_remat as dcr
    from dcr_bench.traffic import closed_form, ring, trace

    ranks = ring.Ranks(world, node_size)
    param_dtype = None if PRECISIONS[precision] is None else getattr(torch, PRECISIONS[precision])
    remat = dcr.RematConfig(mark_parameter_aliases=marking)
    facts = closed_form.parameter_facts(trace.meta_model(hf_config), param_dtype)
    rows = []
    for layout in layouts:
        replicas = ranks.nodes if layout == "hsdp" else 1
        secondary = node_size if layout == "hpz" else 1  # the runtime's node-local re-gathers
        traced_phases = trace.trace_phases(
            hf_config, world=world, param_dtype=param_dtype, remat=remat, replicas=replicas,
            secondary=secondary, extrapolate=extrapolate)
        traced = ring.layout_traffic(layout, traced_phases, ranks)
        formula = closed_form.closed_form(layout, facts, ranks)
        for t, f in zip(traced, formula):
            row = {"layout": layout, "phase": t.phase, "group": t.group,
                   "group_size": t.group_size, "collectives": t.collectives}
            row.update({k: getattr(t, k) for k in _FIGURES})
            row.update({f"formula_{k}": getattr(f, k) for k in _FIGURES})
            row["agree"] = all(_agree(getattr(t, k), getattr(f, k)) for k in _FIGURES)
            rows.append(row)
    model_16bit = closed_form.model_bytes_16bit(facts)
    for row in rows:
        row["model_bytes_16bit"] = model_16bit
    return rows


_UNITS = ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1.0, "bytes"))


def _unit(largest: float) -> tuple[float, str]:
    """The largest decimal unit in which `largest` is at least 1."""
    return next(((scale, name) for scale, name in _UNITS if largest >= scale), _UNITS[-1])


def format_rows(rows: list[dict], ranks_text: str) -> str:
    """The table: per layout, each phase and the step's total, in one decimal unit (GB for a
    7B model) per step."""
    from dcr_bench.bench.tables import format_table

    group_text = {"world": "all ranks", "node": "in a node", "replica": "across nodes"}
    table_rows = []
    for layout in dict.fromkeys(r["layout"] for r in rows):
        mine = [r for r in rows if r["layout"] == layout]
        total = {"layout": layout, "phase": "step total", "group": "", "group_size": "",
                 "collectives": sum(r["collectives"] for r in mine),
                 "agree": all(r["agree"] for r in mine)}
        for k in _FIGURES:
            total[k] = sum(r[k] for r in mine)
            total[f"formula_{k}"] = sum(r[f"formula_{k}"] for r in mine)
        table_rows += mine + [total]
    m = rows[0]["model_bytes_16bit"]
    scale, unit = _unit(max(r["sent_per_rank"] for r in rows))

    def _gb(x: float) -> str:
        return f"{x / scale:.3f}"

    columns = [
        ("layout", lambda r: r["layout"] if r["phase"] == "step total" or r is table_rows[0]
         or r["phase"] == "forward gathers" else ""),
        ("phase", lambda r: r["phase"]),
        ("group", lambda r: f"{r['group_size']} {group_text[r['group']]}" if r["group"] else ""),
        ("colls", lambda r: str(r["collectives"])),
        ("sent/rank", lambda r: _gb(r["sent_per_rank"])),
        ("crossing/rank", lambda r: _gb(r["crossing_per_rank"])),
        ("max/rank", lambda r: _gb(r["crossing_max_rank"])),
        ("leaving a node", lambda r: _gb(r["leaving_node"])),
        ("= xM", lambda r: f"{r['leaving_node'] / m:.3f}"),
        ("formula: leaving a node", lambda r: _gb(r["formula_leaving_node"])),
        ("agree", lambda r: "yes" if r["agree"] else "NO"),
    ]
    head = (f"per step, {unit}; {ranks_text}; rings in rank order; M = the model in 16 bits = "
            f"{_gb(m)} {unit} (ZeRO++ paper: ZeRO-3 moves 3M across nodes, hpZ 2M)")
    return head + "\n" + format_table(table_rows, columns)


def run(args: argparse.Namespace) -> int:
    """Bytes per rank per step that cross node boundaries: flat ZeRO-3, hpZ, HSDP (traced and closed form)."""
    config = model_config(args.model)
    started, cpu = time.perf_counter(), time.process_time()
    rows = measure(config, args.world, args.node_size, args.precision, args.layouts,
                   args.extrapolate, not args.no_marking)
    took = f"traced in {time.perf_counter() - started:.0f} s ({time.process_time() - cpu:.0f} s CPU)"
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        params = rows[0]["model_bytes_16bit"] // 2
        print(f"deepcompile-remat traffic: {args.model} ({type(config).__name__}, "
              f"{config.num_hidden_layers} layers, {params / 1e9:.3f} B parameters), "
              f"{args.precision} gathers, marking {'off' if args.no_marking else 'on'}; {took}")
        print(format_rows(rows, f"{args.world} ranks = {args.world // args.node_size} nodes x "
                                f"{args.node_size}"))
    return 0 if all(r["agree"] for r in rows) else 1
