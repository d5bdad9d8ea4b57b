"""Reproducer: torch's functional all_gather_into_tensor on gloo corrupts the heap when two or
more are in flight at once (seen on torch 2.13.0 CPU: "malloc(): unaligned tcache chunk
detected", SIGSEGV/SIGABRT within seconds). The same pattern through the plain API
(dist.all_gather_into_tensor(async_op=True)) runs clean, and so does one functional gather in
flight at a time. This is why zero3/schedule.py limited gloo to one gather in flight
(limit_in_flight) when the runtime's prefetch used functional collectives; it now gathers
through the plain API (ops/collectives.py gather_slots) and keeps the limit as a precaution.

    python scripts/repro_gloo_functional_collectives.py [IN_FLIGHT] [functional|plain]

Exits 0 after 20000 rounds without a crash; a crash kills a rank and the spawn raises.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, in_flight: int, api: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group_name = dist.group.WORLD.group_name
    c10d = torch.ops._c10d_functional
    for _ in range(20000):
        pending = []
        for k in range(in_flight):
            shard = torch.randn(1000 + 37 * k)
            if api == "functional":
                pending.append(c10d.all_gather_into_tensor.default(shard, world, group_name))
            else:
                full = torch.empty(world * shard.numel())
                pending.append((dist.all_gather_into_tensor(full, shard, async_op=True), shard))
        for p in pending:
            c10d.wait_tensor.default(p) if api == "functional" else p[0].wait()
        _ = [torch.randn(100) for _ in range(50)]  # allocator churn makes corruption visible
    dist.barrier()
    if rank == 0:
        print(f"{api}, {in_flight} in flight: 20000 rounds, no crash")
    dist.destroy_process_group()


if __name__ == "__main__":
    in_flight = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    api = sys.argv[2] if len(sys.argv) > 2 else "functional"
    mp.spawn(_rank, args=(2, in_flight, api, str(29500 + os.getpid() % 1000)), nprocs=2)
