"""A rank process for test_teardown: finishes some gathers, drops their outputs, ends with
zero3.barrier_before_exit() and exits at once, its group still referenced (what a training script's last lines do). Run
as: python rank_ending_with_a_barrier.py RANK WORLD PORT."""
import os
import sys

import torch
import torch.distributed as dist

from deepcompile_remat import zero3

rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=world)
GROUP = dist.group.WORLD  # kept to the end, as FSDP2's mesh or DeepSpeed's engine keeps it
shard = torch.full((1 << 18,), float(rank))
for _ in range(8):
    parts = [torch.empty_like(shard) for _ in range(world)]
    work = dist.all_gather(parts, shard, async_op=True)
    work.wait()
    # The outputs' Python objects go first, so the work frees them when it goes. The barrier
    # right after can catch the last work before gloo's worker has let go of it: then that
    # work goes only when the barrier does.
    del parts, work
zero3.barrier_before_exit()
dist.destroy_process_group()
