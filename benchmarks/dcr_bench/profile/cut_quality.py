"""deepcompile-remat cut-quality: our partitioner against torch's, one process, no ZeRO-3.

The product's cut must be no worse than torch's min-cut on any model a user compiles, sharded
or not. This runs one training step (forward, backward) of each architecture twice per
precision, compiled with the same backend, once with torch's min_cut_rematerialization_partition
(RematConfig(enabled=False)) and once with ours, and reports the step's peak (the allocator's
total over the step, above what was alive before it: the harness's one memory meter) and its
median time. A row is a loss where ours is worse outside the tolerance (--tolerance, default
2% on peak, 10% on time: this shared CPU moves +-10-20% between runs, so a time loss must be
re-run before it is believed).

Architectures are transformers' own classes built from small configs with random weights
(decoder LMs, an encoder-decoder, an encoder, convolutional and patch-embedding vision models):
the classes of op pattern a cut meets (norms, attention, convolutions and their layouts).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

NAME = "cut-quality"

ARCHITECTURES = ("llama", "qwen2", "gpt2", "t5", "bert", "convnext", "resnet", "resnet-basic",
                 "vit")
PRECISIONS = ("fp32", "bf16")  # bf16: CPU autocast


def _lm(cls_name: str, config_name: str, batch: int, seq: int, **config):
    import torch
    import transformers

    model = getattr(transformers, cls_name)(getattr(transformers, config_name)(**config))
    vocab = config.get("vocab_size", 512)

    def inputs():
        ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
        return {"input_ids": ids, "labels": ids}

    return model, inputs


def _vision(cls_name: str, config_name: str, batch: int, image: int, **config):
    import torch
    import transformers

    model = getattr(transformers, cls_name)(getattr(transformers, config_name)(**config))
    labels = config.get("num_labels", 10)

    def inputs():
        g = torch.Generator().manual_seed(0)
        return {"pixel_values": torch.randn(batch, 3, image, image, generator=g),
                "labels": torch.randint(0, labels, (batch,), generator=g)}

    return model, inputs


def build(arch: str, scale: int = 1):
    """(model in train mode with random weights, inputs() -> the step's keyword inputs) for an
    architecture; scale multiplies the sequence (LMs) or the image side (vision)."""
    import transformers

    transformers.logging.set_verbosity_error()
    seq, image = 256 * scale, 64 * scale
    lm = dict(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=seq)
    if arch == "llama":
        model, inputs = _lm("LlamaForCausalLM", "LlamaConfig", 2, seq, **lm)
    elif arch == "qwen2":
        model, inputs = _lm("Qwen2ForCausalLM", "Qwen2Config", 2, seq, **lm)
    elif arch == "gpt2":
        model, inputs = _lm("GPT2LMHeadModel", "GPT2Config", 2, seq, vocab_size=512, n_embd=256,
                            n_layer=2, n_head=4, n_positions=seq)
    elif arch == "t5":
        model, inputs = _lm("T5ForConditionalGeneration", "T5Config", 2, seq, vocab_size=512,
                            d_model=256, d_kv=64, d_ff=688, num_layers=2, num_heads=4,
                            decoder_start_token_id=0, dropout_rate=0.0)
    elif arch == "bert":
        model, inputs = _lm("BertForMaskedLM", "BertConfig", 2, seq, vocab_size=512,
                            hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=seq,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    elif arch == "convnext":
        model, inputs = _vision("ConvNextForImageClassification", "ConvNextConfig", 4, image,
                                hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1],
                                num_labels=10)
    elif arch in ("resnet", "resnet-basic"):
        # basic blocks: 3x3 convs only (the weights inductor saves as channels-last copies)
        blocks = {"layer_type": "basic"} if arch == "resnet-basic" else {}
        model, inputs = _vision("ResNetForImageClassification", "ResNetConfig", 4, image,
                                embedding_size=32, hidden_sizes=[32, 64, 128, 256],
                                depths=[1, 1, 1, 1], num_labels=10, **blocks)
    elif arch == "vit":
        model, inputs = _vision("ViTForImageClassification", "ViTConfig", 4, image,
                                image_size=image, patch_size=8, hidden_size=256,
                                intermediate_size=688, num_hidden_layers=2,
                                num_attention_heads=4, num_labels=10, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0)
    else:
        raise ValueError(f"unknown architecture {arch!r}; choose from {list(ARCHITECTURES)}")
    return model.train(), inputs


def compiled_step(arch: str, partitioner: str, kind: str, precision: str, *, scale: int = 1,
                  checkpointing: bool = False, on_partition=None, config=None,
                  device: str = "cpu", reset: bool = True):
    """A training step of `arch` compiled with backend `kind` and `partitioner`'s cut ("ours"
    or "torch": RematConfig(enabled=False)), compile caches off (a warm cache would skip the
    partitioners being compared): a function running forward and backward at `precision` and
    releasing the gradients. checkpointing: HF's activation checkpointing on every layer;
    on_partition: the backend's hook, called with each (forward, backward) module; config:
    ours' RematConfig (default: the defaults); device: where the model, its inputs and the
    autocast region live ("cpu" or "cuda"); reset: clear dynamo's compiled code first (False
    keeps steps compiled earlier in this process valid, to time them side by side)."""
    import torch

    import deepcompile_remat as dcr
    from deepcompile_remat.config import RematConfig
    from dcr_bench.harness.models import enable_hf_checkpointing

    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    if reset:
        torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs = build(arch, scale)
    if checkpointing:
        enable_hf_checkpointing(model, use_reentrant=False)
    if config is None or partitioner != "ours":
        config = RematConfig(enabled=partitioner == "ours")
    model.to(device)
    run = torch.compile(model, backend=dcr.backend(kind, config, on_partition=on_partition))
    batch = {k: v.to(device) for k, v in inputs().items()}
    device_type = torch.device(device).type

    def step():
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = run(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def _step_peak(step, device) -> float:
    """One step's peak bytes above what was allocated before it (see measure)."""
    import torch

    from dcr_bench.harness.memory import peak_over_profile, profiled

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return float(torch.cuda.max_memory_allocated(device) - start)
    with profiled(profile_memory=True) as prof:
        step()
    return peak_over_profile(prof)


def _timed(step, device, steps: int) -> tuple[list, list]:
    """Wall and CPU seconds of `steps` steps, one each."""
    import torch

    cuda = torch.device(device).type == "cuda"
    times, cpus = [], []
    for _ in range(steps):
        c0, t0 = time.process_time(), time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return times, cpus


def _compiled_and_warm(arch, partitioner, kind, precision, scale, config, device, reset):
    """(step, first step's s): compiled by its first call, then one more step to warm up."""
    import torch

    step = compiled_step(arch, partitioner, kind, precision, scale=scale, config=config,
                         device=device, reset=reset)
    t0 = time.perf_counter()
    step()  # compiles
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    first_step_s = time.perf_counter() - t0
    step()
    return step, first_step_s


def _row(arch, partitioner, kind, precision, device, peak, times, cpus, first_step_s) -> dict:
    return {"arch": arch, "partitioner": partitioner, "kind": kind, "precision": precision,
            "device": str(device), "peak_bytes": peak, "step_s": statistics.median(times),
            "cpu_s": statistics.median(cpus), "first_step_s": first_step_s}


def _release(device) -> None:
    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def measure(arch: str, partitioner: str, kind: str, precision: str, steps: int,
            scale: int = 1, config=None, device: str = "cpu") -> dict:
    """One row: `partitioner` ("ours" or "torch") compiling `arch` with backend `kind` at
    `precision` (ours with `config`, default the defaults) on `device`: the step's peak bytes
    above the start, median step s and CPU s, and the first step's s (compiling it). On CUDA
    the peak is the caching allocator's own (max_memory_allocated over one step, minus what
    was allocated before it) and each timed step ends with a synchronize. Glibc's
    malloc thresholds are fixed first (harness/steady_malloc.py)."""
    from dcr_bench.harness.memory import exact_cpu_counter
    from dcr_bench.harness.steady_malloc import steady_cpu_malloc

    exact_cpu_counter()
    steady_cpu_malloc()
    step, first_step_s = _compiled_and_warm(arch, partitioner, kind, precision, scale, config,
                                            device, reset=True)
    peak = _step_peak(step, device)
    times, cpus = _timed(step, device, steps)
    del step
    _release(device)
    return _row(arch, partitioner, kind, precision, device, peak, times, cpus, first_step_s)


def measure_pair(arch: str, kind: str, precision: str, steps: int, rounds: int = 4,
                 scale: int = 1, device: str = "cpu") -> list:
    """torch's row and ours' (as measure) for one architecture and precision, timed side by
    side: both steps are compiled in this process first, each one's peak is taken over one
    step of its own, then `rounds` rounds of `steps` timed steps alternate between them
    (torch-ours, ours-torch, ...), and each median is over all its rounds. Timed one after the
    other, a drift of this shared machine over the half minute between them fell on one
    partitioner only. With malloc's thresholds fixed as in measure, the two time alike where
    they computed alike (benchmarks/README.md, cut-quality)."""
    from dcr_bench.harness.memory import exact_cpu_counter
    from dcr_bench.harness.steady_malloc import steady_cpu_malloc

    exact_cpu_counter()
    steady_cpu_malloc()
    steps_by = {}
    for which in ("torch", "ours"):
        steps_by[which] = _compiled_and_warm(arch, which, kind, precision, scale, None, device,
                                             reset=which == "torch")
    peaks = {which: _step_peak(steps_by[which][0], device) for which in steps_by}
    times = {which: [] for which in steps_by}
    cpus = {which: [] for which in steps_by}
    for r in range(rounds):
        for which in (("torch", "ours") if r % 2 == 0 else ("ours", "torch")):
            t, c = _timed(steps_by[which][0], device, steps)
            times[which] += t
            cpus[which] += c
    rows = [_row(arch, which, kind, precision, device, peaks[which], times[which], cpus[which],
                 steps_by[which][1]) for which in ("torch", "ours")]
    del steps_by
    _release(device)
    return rows


def verdicts(rows: list, peak_tolerance: float, time_tolerance: float) -> list:
    """One line per (arch, precision): torch's and ours' peak and step time, the ratios, and
    "loss" where ours is worse than torch's beyond the tolerances."""
    by_key = {}
    for r in rows:
        by_key.setdefault((r["arch"], r["kind"], r["precision"]), {})[r["partitioner"]] = r
    out = []
    for (arch, kind, precision), pair in by_key.items():
        if set(pair) != {"ours", "torch"}:
            continue
        t, o = pair["torch"], pair["ours"]
        peak_ratio = o["peak_bytes"] / t["peak_bytes"] if t["peak_bytes"] else 1.0
        time_ratio = o["step_s"] / t["step_s"] if t["step_s"] else 1.0
        losses = [w for w, bad in (("peak", peak_ratio > 1 + peak_tolerance),
                                   ("time", time_ratio > 1 + time_tolerance)) if bad]
        out.append({"arch": arch, "kind": kind, "precision": precision,
                    "torch_peak_mb": t["peak_bytes"] / 2**20, "ours_peak_mb": o["peak_bytes"] / 2**20,
                    "peak_ratio": peak_ratio, "torch_step_s": t["step_s"],
                    "ours_step_s": o["step_s"], "time_ratio": time_ratio, "losses": losses})
    return out


def table(lines: list) -> str:
    """The verdicts as a text table."""
    head = (f"{'arch':<13}{'kind':<9}{'prec':<6}{'torch MB':>10}{'ours MB':>10}{'peak':>8}"
            f"{'torch s':>9}{'ours s':>9}{'time':>8}  verdict")
    rows = [head, "-" * len(head)]
    for v in lines:
        rows.append(f"{v['arch']:<13}{v['kind']:<9}{v['precision']:<6}{v['torch_peak_mb']:>10.1f}"
                    f"{v['ours_peak_mb']:>10.1f}{(v['peak_ratio'] - 1) * 100:>+7.1f}%"
                    f"{v['torch_step_s']:>9.3f}{v['ours_step_s']:>9.3f}"
                    f"{(v['time_ratio'] - 1) * 100:>+7.1f}%  "
                    f"{'loss: ' + ', '.join(v['losses']) if v['losses'] else 'ok'}")
    return "\n".join(rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's flags."""
    p.add_argument("--archs", nargs="+", choices=ARCHITECTURES, default=list(ARCHITECTURES))
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    p.add_argument("--kind", choices=("inductor", "eager"), default="inductor",
                   help="the backend both partitioners compile with (default inductor)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=4,
                   help="alternating rounds of --steps timed steps per partitioner (the median "
                        "is over all of them)")
    p.add_argument("--scale", type=int, default=1,
                   help="sequence (x256) or image side (x64) multiplier")
    p.add_argument("--peak-tolerance", type=float, default=0.02)
    p.add_argument("--time-tolerance", type=float, default=0.10)
    p.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")


def run(args) -> int:
    """Our partitioner against torch's on transformers architectures: step peak and time."""
    rows = [row for arch in args.archs for precision in args.precisions
            for row in measure_pair(arch, args.kind, precision, args.steps, args.rounds,
                                    args.scale, device=args.device)]
    lines = verdicts(rows, args.peak_tolerance, args.time_tolerance)
    print(json.dumps(lines, indent=1) if args.json else table(lines))
    return 0
