"""Memory-profile experiments: `deepcompile-remat profile`.

The matrix {eager, inductor} x {autocast, bf16} x {unbucketed, baseline, regather, ours} on a
built-in GPT (or a transformers model), sharded by ZeRO-3 over N local ranks (gloo on CPU, NCCL
on GPU) or an emulated world (torch's fake process group); `deepcompile-remat compare`, ours
against FSDP2 and DeepSpeed; and `deepcompile-remat frontier`, peak against step time over
settings of each. Modules, one job each (the model, the memory meter and the rank
spawner are the harness's: benchmarks/dcr_bench/harness):

  setups      the cells and the RematConfig of each setup (ours@B: --budgets, budget mode)
  partitions  what a partition saves for the backward, and the simulator's predicted peaks
  measure     one rank's run of the matrix
  results     fold the rows into cells; the table (PR #7609's layout), details, the budget
              table, footer; results.json / results.csv
  plots       PNG timelines, the bar chart of peaks, the budget trade (peak vs step time)
  command     the `profile` subcommand
  peers       the systems `compare` runs
  compare     the `compare` subcommand
  frontier    the `frontier` subcommand: compare's points over settings, the Pareto front and
              the physical floor
"""
