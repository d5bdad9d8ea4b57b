#!/usr/bin/env bash
# Runs the pytest suite against torch 2.11 (the torch of the GPU machine) on this CPU, in a
# virtual environment of its own (.venv-torch211, git-ignored). CI stays on the pinned 2.13
# (scripts/test.sh); this is the second version the code must pass on. PyPI's torch 2.11 wheel
# carries its CUDA libraries (a few GB); it runs on the CPU all the same.
#   bash scripts/test_torch211.sh [pytest args: paths, -k, -x ...]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DCR_TORCH211_VENV:-.venv-torch211}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "torch==2.11.0"   # pinned first: pip never resolves torch alone
"$PY" -m pip install -q -r requirements-dev.txt
"$PY" -m pip install -q --no-build-isolation "deepspeed==0.19.8"
# The native module never links libtorch: build it for this Python, in place, once per tree.
"$PY" setup.py -q build_ext --inplace >/dev/null
# DeepSpeed JIT-builds its CPU comm op against the torch it runs with: a cache of its own.
export TORCH_EXTENSIONS_DIR="$PWD/$VENV/torch_extensions"
export PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"  # the product and its tools (dcr_bench), also in subprocesses
"$PY" -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"
"$PY" -m pytest "$@"  # pyproject testpaths: every test when no path is given
