"""dcr_bench: the measurement tools of deepcompile_remat, kept apart from the product.

The `deepcompile-remat` command (cli.py) and its subcommands: `profile` and `compare`
(profile/: measured memory and time of whole steps, against FSDP2 and DeepSpeed) and `bench-*`
(bench/: the solver, the partitioner, budget mode and the DeepSpeed takeover, against torch's
and DeepSpeed's own). harness/ holds what they and the tests share: the models, the workload, the
memory meter and the rank spawner. The product (deepcompile_remat) never imports this package,
so editing a benchmark never touches users' compile caches.
"""
