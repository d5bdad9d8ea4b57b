"""Memory-profile experiments: `deepcompile-remat profile`.

The matrix {eager, inductor} x {autocast, bf16} x {baseline, marking, ours} on a built-in GPT,
sharded by ZeRO-3 over N local ranks (gloo on CPU, NCCL on GPU) or an emulated world (torch's
fake process group). Modules, one job each:

  setups      the cells and the RematConfig of each setup
  partitions  what a partition saves for the backward, and the simulator's predicted peaks
  memory      the allocator's running total over one step, forward/backward split
  measure     one rank's run of the matrix
  report      the table (PR #7609's layout), details, footer, results.json / results.csv
  plots       PNG timelines and the bar chart of peaks
  command     the CLI subcommand
"""
