#!/usr/bin/env bash
# Installs everything deepcompile_remat needs on a fresh Debian machine, then the package itself
# (editable). Idempotent. torch is pinned and installed first so pip never resolves it alone.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION="${DCR_TORCH_VERSION:-2.13.0}"

# Native build and C++ tests: compiler, CMake/Ninja (pip), GoogleTest (Debian).
if ! [ -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ] && \
   ! [ -f /usr/lib/aarch64-linux-gnu/cmake/GTest/GTestConfig.cmake ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq g++ libgtest-dev >/dev/null
fi

python3 -m pip install -q --upgrade pip
python3 -m pip install -q "torch==${TORCH_VERSION}"
python3 -m pip install -q -r requirements-dev.txt
# DeepSpeed, for deepcompile_remat.deepspeed and its tests: after torch (it builds against the
# installed torch, hence no build isolation), pinned to the version the takeover was read from.
python3 -m pip install -q --no-build-isolation "deepspeed==0.19.8"
# Its CPU shared-memory comm op is JIT-built the first time DeepSpeed initializes (about a
# minute); build it here, once (cached under ~/.cache/torch_extensions), not inside a test.
DS_ACCELERATOR=cpu python3 -c "from deepspeed.accelerator import get_accelerator
b = get_accelerator().create_op_builder('ShareMemCommBuilder')
b is None or b.load()" >/dev/null
python3 -m pip install -q --no-build-isolation -e .
