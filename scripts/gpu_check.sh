#!/usr/bin/env bash
# On a GPU machine (no network): build the extension with the CUDA/NCCL module for Hopper, run
# the GPU tests (and the CPU ones that check torch-version compatibility), then the GPU
# benchmark. Logs go to $OUT when set (the device tool), else to bench_out/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench_out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-16}"
export CMAKE_ARGS="${CMAKE_ARGS:--DCMAKE_CUDA_ARCHITECTURES=90}"
nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__)"
python3 -m pip install -v --no-deps --no-build-isolation -e . >"$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
python3 -c "from deepcompile_remat import ops; print('cuda module:', ops.cuda_available(), ops.cuda_build_info())"
grep -E "deepcompile_remat: (CUDA|skipping)" "$OUT/build.log"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/python/test_cast_ops.py tests/python/test_cast_ops_gpu.py tests/python/test_zero3_gpu.py 2>&1 | tail -25
timeout 200 python3 -m pytest -v -p no:cacheprovider tests/python/test_partition.py -k "not model_gradients" >"$OUT/partition_tests.log" 2>&1
grep -E "PASSED|FAILED|ERROR|Fatal|Segmentation|passed|failed" "$OUT/partition_tests.log" | tail -40
timeout 200 python3 benchmarks/bench_allgather_cast.py 2>&1 | tee "$OUT/bench_allgather_cast.txt" | tail -30
