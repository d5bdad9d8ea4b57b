"""`deepcompile-remat traffic`: the bytes a training step moves per rank, and how many of them
cross node boundaries, for flat ZeRO-3, hybrid sharding (HSDP) and ZeRO++-style node-local
re-gathers (hpZ), at a given world and node size, on paper.

trace.py traces one step of a transformers model on the meta device under torch's fake process
group (nothing is allocated) and reads the collectives from the partitioned forward and
backward graphs; ring.py says which of their bytes cross a node boundary when each runs as a
ring in rank order; closed_form.py derives the same figures from the parameter counts alone;
command.py prints them side by side.
"""
