"""`deepcompile-remat compare`: ours against what a user would pick
instead (profile/peers.py), on the same model, micro-batch, seed and ranks, a full training step
with AdamW each.

    deepcompile-remat compare                                  # built-in GPT, 2 CPU ranks
    deepcompile-remat compare --model llama --layers 4 --hidden 256 --checkpointing
    deepcompile-remat compare --model path/to/config.json --peers ours-eager fsdp2-module

Per system and precision, on every rank (folded: the memory figures of the rank with the
largest step peak, the slowest rank's time):
  step peak    the allocator's absolute total at its highest over one whole step (forward,
               backward, optimizer step, gradients released): what runs out of memory
  at rest      the total when the step begins: model, optimizer state, buffers a system keeps
               between steps (DeepSpeed's gradient partitions, ...)
  transient    the highest total during forward + backward, minus at rest
  time         median step time over the timed steps (wall, the slowest rank) and this
               process's CPU time (all its threads: steadier on a shared machine)
  wait s       median over the timed steps of the time the step's host spent blocked in
               collectives' waits (harness/comm_wait.py: every Work.wait, synchronous
               collectives included; on a GPU the host does not block there)
  collectives  torch.distributed collectives one step issues (a coalesced group counts once)
  step-1 loss  the loss before any update: every system must agree (bf16 tolerance), else the
               row is marked
results.json also says which system ran: our_partitions (graphs our partitioner cut, 0 for
the stock systems) and, for the DeepSpeed systems, taken_over (our takeover holds the engine).
CPU memory is the CPU allocator's running total made exact in every thread
(memory.exact_cpu_counter, set before anything is allocated); on a GPU the CUDA allocator's.
Each system runs in processes of its own, so nothing one leaves behind counts for the next.
A system that cannot run here says why in its row. What the rank processes print (DeepSpeed's
banners, library warnings) goes to <out>/logs/<system>-<precision>.rank<r>.log, not the terminal:
the terminal shows one progress line and the table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

from dcr_bench.harness.ranks import share_cores
from dcr_bench.harness.workload import (Workload, add_model_arguments,
                                                 workload_from_args)

NAME = "compare"
DEFAULT_PEERS = ("ours-eager", "ours-inductor", "ours-inductor-layer-buckets", "ours-inductor-mp",
                 "ours-deepspeed", "fsdp2-block", "fsdp2-block-compiled", "fsdp2-module",
                 "deepspeed", "deepspeed-lean", "deepspeed-compiled", "deepspeed-lean-compiled")
# Run only when named (--peers): dcr.compile (the README's program; with FSDP2's bf16
# parameters instead of autocast, -mp); ours compiled per layer (peers.py), a frontier point;
# stock DeepSpeed and the takeover with the optimizer, the parameters or both offloaded to the
# host; both under DeepSpeed's pure-bf16 keys.
OTHER_PEERS = ("ours-compile", "ours-compile-mp", "ours-inductor-blocks",
               "ours-inductor-blocks-grad-buckets", "ours-deepspeed-offload",
               "deepspeed-lean-offload",
               "ours-deepspeed-offload-params", "deepspeed-lean-offload-params",
               "ours-deepspeed-offload-all", "deepspeed-lean-offload-all",
               "ours-deepspeed-bf16-master", "deepspeed-lean-bf16-master")
PRECISIONS = ("autocast", "bf16")
LOSS_RTOL = 2e-2  # bf16 compute: 8 bits of mantissa, summed over a vocabulary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the compare command's flags (the model, the peers, precisions, ranks, steps) to
    `parser`."""
    add_model_arguments(parser)
    g = parser.add_argument_group("run")
    g.add_argument("--peers", nargs="+", choices=DEFAULT_PEERS + OTHER_PEERS,
                   default=list(DEFAULT_PEERS))
    g.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    g.add_argument("--ours-config", default="{}", metavar="JSON",
                   help='RematConfig fields for the ours-* systems, e.g. \'{"bucket_bytes": '
                        '16777216}\' (the same keys as the DeepSpeed block)')
    g.add_argument("--world", type=int, default=2, help="local ranks (gloo on CPU, NCCL on GPU)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    g.add_argument("--warmup", type=int, default=1, help="steps after the first (compiling) one")
    g.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    g.add_argument("--out", default="compare-results", help="output folder")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--quiet", action="store_true", help="no progress line")
    g.add_argument("--json", action="store_true", help="print the rows as JSON, no table")
    add_rank_arguments(g)


def add_rank_arguments(g) -> None:
    """The flags of how each rank process measures (compare and frontier)."""
    g.add_argument("--dynamic-malloc", action="store_true",
                   help="keep glibc's adaptive malloc thresholds in the rank processes (by "
                        "default they are fixed, harness/steady_malloc.py, so no system's step "
                        "time depends on its process's history)")
    g.add_argument("--op-table", action="store_true",
                   help="rank 0 writes the profiled step's ops by self CPU time (and device "
                        "time on a GPU) to "
                        "<out>/logs/<system>-<precision>[-ckpt].ops.txt (where a system's "
                        "time goes), and what is alive at its memory peak to .peak.txt")


def rank_options(args: argparse.Namespace) -> dict:
    """rank_main's options from add_rank_arguments' flags."""
    return {"steady_malloc": not args.dynamic_malloc, "op_table": args.op_table}


def _step_figures(prof, device_type: str) -> dict:
    """At rest, step peak and forward+backward peak (absolute), and the collectives, from a
    profile of exactly one step."""
    from dcr_bench.harness import memory
    from dcr_bench.profile.peers import FWD_BWD

    tree = memory.event_tree(prof)
    events = memory.allocation_events(tree, device_type)
    if not events:
        return {"at_rest_bytes": float("nan"), "step_peak_bytes": float("nan"),
                "transient_bytes": float("nan"), "collectives": 0}
    at_rest = float(events[0][1] - events[0][2])
    marks = memory.step_marks(tree, (FWD_BWD,))
    start, end = marks.get(FWD_BWD, (events[0][0], events[-1][0]))
    fwd_bwd = [e[1] for e in events if start <= e[0] <= end] or [at_rest]
    collectives = sum(1 for n in tree.sorted_nodes if n.name.startswith("c10d::")
                      and "barrier" not in n.name)
    return {"at_rest_bytes": at_rest, "step_peak_bytes": float(max(e[1] for e in events)),
            "transient_bytes": float(max(fwd_bwd)) - at_rest, "collectives": collectives}


def rank_main(rank: int, world: int, port: int, peer: str, precision: str, workload: dict,
              opts: dict) -> list:
    """Entry point of one rank process: builds `peer` at `precision`, runs its first step,
    warm-up and timed steps, profiles one step, and returns this rank's one row (the reason
    instead of figures when the peer is unavailable or fails)."""
    device_type = opts["device"]
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if device_type == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    say = (_progress(f"[{peer} {precision}] ") if opts["progress"] and rank == 0
           else (lambda msg: None))
    tag = f"{peer}-{precision}" + ("-ckpt" if workload.get("checkpointing") else "")
    log = _log_to_file(os.path.join(opts["log_dir"], f"{tag}.rank{rank}.log"))
    from dcr_bench.harness import comm_wait, memory
    from dcr_bench.harness.steady_malloc import steady_cpu_malloc

    exact = memory.exact_cpu_counter() if device_type == "cpu" else True  # before allocating
    if opts.get("steady_malloc", True):
        steady_cpu_malloc()
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity

    from dcr_bench.profile.peers import PEERS, Unavailable

    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    share_cores(world)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    w = Workload(**workload)
    row = {"peer": peer, "precision": precision, "rank": rank, "world": world,
           "exact_counter": exact}
    system = None
    try:
        say("building")
        system = PEERS[peer](w, precision, device, opts["ours_config"])
        row["notes"] = system.notes
        row.update(system.facts)
        batch = w.inputs(rank, device)
        say("compiling / first step")
        t0 = time.perf_counter()
        row["step1_loss"] = system.step(batch)
        row["first_step_s"] = time.perf_counter() - t0
        for _ in range(opts["warmup"]):
            system.step(batch)
        times, cpu_times, waits = [], [], []
        for i in range(opts["steps"]):
            say(f"step {i + 1}/{opts['steps']}")
            dist.barrier()
            with comm_wait.blocked() as blocked:
                t0, c0 = time.perf_counter(), time.process_time()
                system.step(batch)
                if device_type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                cpu_times.append(time.process_time() - c0)
            waits.append(blocked[0])
        row["step_s"] = statistics.median(times)
        row["cpu_s"] = statistics.median(cpu_times)
        row["comm_wait_s"] = statistics.median(waits)
        dist.barrier()
        say("profiling a step")
        activities = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if device_type == "cuda" else [])
        with memory.profiled(activities=activities, profile_memory=True) as prof:
            system.step(batch)
        row.update(_step_figures(prof, device_type))
        if opts.get("op_table") and rank == 0:
            with open(os.path.join(opts["log_dir"], f"{tag}.ops.txt"), "w") as f:
                f.write(memory.op_table(prof, device_type, tag, row_limit=40))
            with open(os.path.join(opts["log_dir"], f"{tag}.peak.txt"), "w") as f:
                f.write(memory.live_at_peak(prof, device_type, tag, depth=4, rows=20))
        row["held_at_rest"] = system.held()
        from deepcompile_remat.partition.report import reports

        row["our_partitions"] = len(reports())  # graphs our partitioner cut in this process
        plans = [r.plan for r in reports() if r.plan is not None]  # peak-target mode
        if plans:
            # The largest graph's simulated peak above its inputs (shards, batch): what the
            # step adds to the memory at rest, by the planner's prediction.
            row["plan_predicted_bytes"] = max(p.predicted_peak_bytes - p.inputs_bytes
                                              for p in plans)
            row["plan_families"] = sorted({p.family for p in plans})
    except Unavailable as e:
        row["unavailable"] = str(e)
    except Exception as e:  # noqa: BLE001  (a peer that fails here says why in its row)
        import traceback

        traceback.print_exc()  # into the log; the row says where it is
        first = str(e).splitlines()[0] if str(e) else ""
        row["failed"] = f"{type(e).__name__}: {first}"[:300] + f" (log: {log})"
    finally:
        if system is not None:
            system.close()
        dist.destroy_process_group()
    say(None)
    return [row]


def _progress(prefix: str):
    """A progress line on the terminal's stderr, kept when fds 1 and 2 go to the log: rewritten
    in place on a terminal, a line per stage otherwise (CI logs). say(None) clears it."""
    stream = os.fdopen(os.dup(2), "w", buffering=1)
    tty = stream.isatty()
    width = [0]

    def say(msg):
        if msg is None:
            if tty:
                stream.write("\r" + " " * width[0] + "\r")
            stream.flush()
            return
        text = prefix + msg
        if tty:
            stream.write("\r" + text.ljust(width[0]))
            width[0] = max(width[0], len(text))
        else:
            stream.write(text + "\n")
        stream.flush()

    return say


def _log_to_file(path: str) -> str:
    """Sends this process's fds 1 and 2 (Python's print and warnings, and C++ and DeepSpeed's own
    output) to `path`."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return path


def fold(rows: list) -> list:
    """One entry per (precision, peer), in run order: the memory figures of the rank with the
    largest step peak (one rank's, so at rest + transient <= step peak holds in every entry),
    the largest time and count over ranks, per-rank step-1 losses, and the reason a system did
    not run."""
    import math

    out: dict = {}
    for r in rows:
        out.setdefault((r["precision"], r["peer"]), []).append(r)
    folded = []
    for (precision, peer), rs in out.items():
        rs.sort(key=lambda r: r["rank"])
        why = next((r.get("unavailable") or r.get("failed") for r in rs
                    if "unavailable" in r or "failed" in r), None)
        entry = {"precision": precision, "peer": peer, "ranks": len(rs), "why_not": why,
                 "notes": rs[0].get("notes", []),
                 "step1_losses": [r.get("step1_loss", math.nan) for r in rs],
                 "exact_counter": all(r.get("exact_counter", True) for r in rs),
                 # DeepSpeed systems: every rank's engine taken over by ours (else None)
                 "taken_over": (all(r["taken_over"] for r in rs)
                                if all("taken_over" in r for r in rs) else None),
                 "our_partitions": min(r.get("our_partitions", 0) for r in rs)}
        if any("plan_predicted_bytes" in r for r in rs):
            entry["plan_predicted_bytes"] = max(r.get("plan_predicted_bytes", 0) for r in rs)
            entry["plan_families"] = sorted({f for r in rs for f in r.get("plan_families", [])})
        measured = [r for r in rs if "step_peak_bytes" in r]
        worst = max(measured, key=lambda r: r["step_peak_bytes"]) if measured else {}
        for key in ("step_peak_bytes", "at_rest_bytes", "transient_bytes"):
            entry[key] = worst[key] if key in worst and why is None else math.nan
        for key in ("step_s", "cpu_s", "comm_wait_s", "collectives", "first_step_s"):
            values = [r[key] for r in rs if key in r]
            entry[key] = max(values) if values and why is None else math.nan
        folded.append(entry)
    _mark_losses(folded)
    return folded


def _mark_losses(folded: list) -> None:
    """loss_ok: every rank's step-1 loss within LOSS_RTOL of the reference system's (ours-eager,
    else the first that ran) on the same rank."""
    import math

    for precision in {e["precision"] for e in folded}:
        group = [e for e in folded if e["precision"] == precision and e["why_not"] is None]
        ref = next((e for e in group if e["peer"] == "ours-eager"), group[0] if group else None)
        for e in group:
            e["loss_ok"] = all(abs(a - b) <= LOSS_RTOL * max(1.0, abs(b))
                               for a, b in zip(e["step1_losses"], ref["step1_losses"])
                               if not (math.isnan(a) or math.isnan(b)))
            e["loss_reference"] = ref["peer"]


def render(folded: list, meta: dict) -> str:
    """The folded rows as the text table the terminal and table.txt show, headed by meta's
    title and definition."""
    import math

    from dcr_bench.profile.results import unit_of

    scale, unit = unit_of([e["step_peak_bytes"] for e in folded])
    name = max([len("system")] + [len(e["peer"]) for e in folded])
    lines = [meta["title"], meta["definition"], ""]
    head = (f"{'precision':<9} {'system':<{name}} {'step peak':>10} {'at rest':>9} "
            f"{'transient':>10} {'step s':>8} {'cpu s':>7} {'wait s':>7} {'colls':>6} "
            f"{'step-1 loss':>12}")
    lines += [f"memory in {unit} per rank (largest rank); time: median step", head,
              "-" * len(head)]
    for e in folded:
        if e["why_not"] is not None:
            lines.append(f"{e['precision']:<9} {e['peer']:<{name}} not run: {e['why_not']}")
            continue
        mark = "" if e.get("loss_ok", True) else "  !loss"
        lines.append(
            f"{e['precision']:<9} {e['peer']:<{name}} {e['step_peak_bytes'] / scale:>10.1f} "
            f"{e['at_rest_bytes'] / scale:>9.1f} {e['transient_bytes'] / scale:>10.1f} "
            f"{e['step_s']:>8.3f} {e['cpu_s']:>7.3f} {e.get('comm_wait_s', math.nan):>7.3f} "
            f"{e['collectives']:>6.0f} "
            f"{e['step1_losses'][0]:>12.4f}{mark}")
    lines.append("")
    if any(not e.get("loss_ok", True) for e in folded):
        lines.append("!loss: step-1 loss differs from the reference system's by more than "
                     f"{LOSS_RTOL:.0%} on some rank (reference: ours-eager).")
    notes = {}
    for e in folded:
        for n in e["notes"]:
            notes.setdefault(e["peer"], set()).add(n)
    if notes:
        lines.append("notes:")
        lines += [f"  {peer}: {'; '.join(sorted(ns))}" for peer, ns in notes.items()]
    return "\n".join(lines)


def plot(folded: list, path: str, title: str):
    """One panel per precision: at rest + transient = step peak, one bar per system."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from dcr_bench.profile.results import unit_of

    precisions = list(dict.fromkeys(e["precision"] for e in folded))
    scale, unit = unit_of([e["step_peak_bytes"] for e in folded])
    fig, axes = plt.subplots(1, len(precisions), figsize=(6 * len(precisions), 4.5),
                             squeeze=False)
    for ax, precision in zip(axes[0], precisions):
        group = [e for e in folded if e["precision"] == precision and e["why_not"] is None]
        names = [e["peer"] for e in group]
        rest = [e["at_rest_bytes"] / scale for e in group]
        peak = [e["step_peak_bytes"] / scale for e in group]
        ax.barh(names, rest, color="#9bb7d4", label="at rest")
        ax.barh(names, [p - r for p, r in zip(peak, rest)], left=rest, color="#d46a6a",
                label="step peak above rest")
        ax.invert_yaxis()
        ax.set_xlabel(f"{unit} per rank")
        ax.set_title(precision)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    """Ours against FSDP2 and stock DeepSpeed ZeRO-3: whole-step memory, time, collectives."""
    import datetime

    import torch

    from dcr_bench.harness.ranks import free_port, spawn_for_rows

    if args.world < 1 or args.steps < 1 or args.warmup < 0:
        raise SystemExit("deepcompile-remat compare: --world and --steps >= 1, --warmup >= 0")
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        raise SystemExit(f"deepcompile-remat compare: --world {args.world} needs that many GPUs")
    w = workload_from_args(args, NAME)
    workload = dataclasses.asdict(w)
    params = sum(p.numel() for p in w.build("autocast").parameters())
    try:
        ours_config = json.loads(args.ours_config)
        from deepcompile_remat.config import RematConfig

        RematConfig.from_dict(ours_config, where="--ours-config")  # a typo fails here, once
    except (json.JSONDecodeError, ValueError) as e:
        raise SystemExit(f"deepcompile-remat compare: {e}")
    opts = {"device": args.device, "warmup": args.warmup, "steps": args.steps,
            "progress": not args.quiet, "ours_config": ours_config,
            "log_dir": os.path.abspath(os.path.join(args.out, "logs")),
            **rank_options(args)}
    t0 = time.perf_counter()
    rows = []
    for precision in args.precisions:
        for peer in args.peers:
            rows += spawn_for_rows(rank_main, args.world, args.world, free_port(), peer,
                                   precision, workload, opts)
    folded = fold(rows)
    wall = time.perf_counter() - t0
    title = (f"{w.describe(params)}; {args.world} {'gloo CPU' if args.device == 'cpu' else 'NCCL GPU'} "
             f"ranks; torch {torch.__version__}; {datetime.date.today().isoformat()}")
    meta = {"title": title, "command": "deepcompile-remat " + " ".join(sys.argv[1:]),
            "definition": "step = forward + backward + AdamW step + gradients released "
                          "(each system's own API); memory is the allocator's absolute total",
            "wall_s": wall, "workload": workload, "parameters": params,
            "ours_config": ours_config}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "folded": folded}, f, indent=1)
    _write_csv(os.path.join(args.out, "results.csv"), folded)
    text = render(folded, meta) + f"\n\nwall time {wall:.0f} s"
    with open(os.path.join(args.out, "table.txt"), "w") as f:
        f.write(text + "\n")
    made = [] if args.no_plots else [p for p in [plot(folded, os.path.join(args.out, "peers.png"),
                                                      title)] if p]
    if args.json:
        print(json.dumps(rows))
    else:
        print(text)
        print("\nwrote " + ", ".join([os.path.join(args.out, n) for n in
                                      ("results.json", "results.csv", "table.txt")] + made))
    return 0


def _write_csv(path: str, folded: list) -> None:
    import csv

    keys = ["precision", "peer", "step_peak_bytes", "at_rest_bytes", "transient_bytes", "step_s",
            "cpu_s", "comm_wait_s", "collectives", "first_step_s", "loss_ok", "why_not"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys + ["step1_loss_rank0"], extrasaction="ignore")
        writer.writeheader()
        for e in folded:
            writer.writerow({**e, "step1_loss_rank0": e["step1_losses"][0]})
