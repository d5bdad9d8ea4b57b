"""Where a compare peer's first step (it compiles) spends its time: cProfile of rank 0's first
step, 2 gloo ranks, llama 4 layers hidden 256 autocast; prints the first and second step's
seconds per rank and writes the profile (pstats) beside a text dump of its top entries.

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) PYTHONPATH=benchmarks \
        python benchmarks/scripts/first_step_profile.py ours-deepspeed 256 /tmp/prof

Arguments: the peer (dcr_bench.profile.peers.PEERS), the sequence length, the output folder,
and optionally the number of layers (4).
Give each run a fresh inductor cache: a warm one skips the compile this looks at.
FIRST_STEP_PROFILE=0: time the steps without the profiler (no profile written). Each rank's
row also gives dynamo's timed compile phases (seconds, summed over the step's compiles)."""
import cProfile
import io
import os
import pstats
import sys
import time

from dcr_bench.harness.ranks import free_port, spawn_for_rows


def rank_main(rank, world, port, peer, seq, out, layers=4):
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
                      TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    import torch
    import torch.distributed as dist

    from dcr_bench.harness.workload import Workload
    from dcr_bench.profile.peers import PEERS

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    w = Workload(model="llama", layers=layers, hidden=256, heads=4, seq=seq)
    t0 = time.perf_counter()
    system = PEERS[peer](w, "autocast", torch.device("cpu"), {})
    build_s = time.perf_counter() - t0
    batch = w.inputs(rank, torch.device("cpu"))
    prof = cProfile.Profile()
    profiling = os.environ.get("FIRST_STEP_PROFILE", "1") != "0"
    t0 = time.perf_counter()
    if profiling:
        prof.enable()
    system.step(batch)
    prof.disable()
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    system.step(batch)
    second_s = time.perf_counter() - t0
    if rank == 0 and profiling:
        os.makedirs(out, exist_ok=True)
        prof.dump_stats(os.path.join(out, f"{peer}.prof"))
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(80)
        with open(os.path.join(out, f"{peer}.txt"), "w") as f:
            f.write(text.getvalue())
    from torch._dynamo.utils import compilation_time_metrics
    # dynamo's timed phases (dynamo_timed), seconds summed over the step's compiles: where the
    # compile's share of the first step goes, without a profiler's overhead
    phases = {k: round(sum(v), 3) for k, v in compilation_time_metrics.items() if sum(v) >= 0.05}
    dist.destroy_process_group()
    return [dict(peer=peer, rank=rank, build_s=build_s, first_s=first_s, second_s=second_s,
                 compile_phases=phases)]


if __name__ == "__main__":
    peer, seq, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    layers = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    for row in spawn_for_rows(rank_main, 2, 2, free_port(), peer, seq, out, layers):
        print(row)
