#!/usr/bin/env bash
# Build-time dependencies of the optional CUDA module (ops/): the NCCL headers + library from
# the pinned pip wheel, where ops/CMakeLists.txt looks for them (python -c "import nvidia.nccl").
# Without nvcc there is nothing to build: say so and succeed (the CPU package still builds).
set -euo pipefail
NCCL_WHEEL_VERSION="${DCR_NCCL_VERSION:-2.32.3}"
NVCC="$(command -v nvcc || true)"
if [ -z "$NVCC" ]; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
    if [ -x "$d/nvcc" ]; then NVCC="$d/nvcc"; break; fi
  done
fi
if [ -z "$NVCC" ]; then
  echo "install_cuda_deps: no nvcc found; the CUDA module (deepcompile_remat._cuda) will be skipped"
  exit 0
fi
if python3 -c "import nvidia.nccl, os, sys; p = list(nvidia.nccl.__path__)[0]; sys.exit(0 if os.path.exists(os.path.join(p, 'include', 'nccl.h')) else 1)" 2>/dev/null; then
  echo "install_cuda_deps: NCCL headers already installed"
  exit 0
fi
echo "install_cuda_deps: $NVCC found; installing nvidia-nccl-cu13==${NCCL_WHEEL_VERSION}"
python3 -m pip install -q "nvidia-nccl-cu13==${NCCL_WHEEL_VERSION}"
