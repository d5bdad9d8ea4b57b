#!/usr/bin/env bash
# Here (with network): the wheels the GPU machine lacks, for scripts/gpu_check.sh to install there
# with no network. DeepSpeed (pure Python, built here without its ops) and the pure-Python or
# cp312 packages it needs that the GPU image does not have (hjson, pydantic and its parts).
# Writes wheels/ (git-ignored); name it in the device tool's `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p wheels
python3 -m pip wheel -q --no-deps --no-build-isolation -w wheels/ "deepspeed==0.19.8"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d wheels/ \
  hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions
ls -la wheels/
