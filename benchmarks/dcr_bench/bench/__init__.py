"""Benchmarks behind the `deepcompile-remat bench-*` commands, and their synthetic graphs."""
