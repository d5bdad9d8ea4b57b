"""A rank process for test_teardown: starts gathers and exits without their waits (what a step
that raised between a start and its wait leaves), its group still referenced (as DeepSpeed's
engine holds its groups). Run as: python rank_leaving_gathers_in_flight.py RANK WORLD PORT."""
import os
import sys

import torch
import torch.distributed as dist

import deepcompile_remat.zero3  # noqa: F401  (the dcr ops and the exit hook)

rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=world)
GROUP = dist.group.WORLD  # kept to the end, like a library's reference
shard = torch.full((1 << 20,), float(rank))
for _ in range(4):
    torch.ops.dcr.allgather_cast_start(shard, world, GROUP.group_name, None)
