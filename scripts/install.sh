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
if [ -f scripts/install_cuda_deps.sh ]; then bash scripts/install_cuda_deps.sh; fi
python3 -m pip install -q --no-build-isolation -e .
