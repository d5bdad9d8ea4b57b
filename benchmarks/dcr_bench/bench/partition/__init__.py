"""bench-partition: our partition_fn against torch's min_cut_rematerialization_partition.

Joint graphs are captured once through torch.compile with AOTAutograd; each partitioner then
gets its own deep copy of the same joint graph, so both solve identical inputs in one run.

Depth sweep (--layers, GPT 2 to 48 layers): per model, graph nodes, wall time of each
partition call, saved bytes (all saved tensors, and those that are not parameters), and the
number of compute-intensive forward ops each recomputes in the backward.

End-to-end speed (--graphs: the 24-layer GPT encoder, a 16-layer transformers Llama): medians
of --reps calls, alternated so load changes hit all alike, of torch's whole call, ours, and
ours "before" (FX's DCE, torch's fx_graph_cse and torch's extraction: the passes ours
replaced; remat_partition_fn(..., torch_passes=True)), with our phases (PartitionReport's
prepare / export / solve / extract, extract split into place / order / build) and the min-max
spread.

--compile-share: instead, the partitioner's share of a whole torch.compile (first forward +
backward less a warm step) on the eager and inductor backends, before and after.

Modules, one job each: command (the `deepcompile-remat bench-partition` flags and run),
depth_sweep, speed (end to end), compile_share, tables (the text output); the joint graphs
come from bench/joint_capture.py, which bench-budget shares.
"""
