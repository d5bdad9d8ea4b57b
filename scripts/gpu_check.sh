#!/usr/bin/env bash
# The GPU check, for the lent GPU machine as it is (torch 2.11 + CUDA 13, Python 3.12, no
# network): versions first, then the build (the CUDA cast module for Hopper, against that
# Python's headers), carried wheels (DeepSpeed and what it needs: scripts/gpu_wheels.sh builds them here),
# the GPU tests, the kernel benchmark, our cut against torch's and the peak planner at sequence
# 1024, the memory profile on the GPU, and last the CPU tests that check this torch (the GPU
# parts first: a short lease that runs out still gets them). No timeout cuts a suite short: the
# device tool's own limit is the only one.
# Logs go to $OUT when set (the device tool), else to bench_out/.
#   bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench_out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-16}"
export CMAKE_ARGS="${CMAKE_ARGS:--DCMAKE_CUDA_ARCHITECTURES=90}"
status=0
step() { echo; echo "=== $*"; }

step "versions"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || status=1
python3 - <<'PY' || status=1
import platform, sys, torch
# The driver's CUDA version: a private call that not every torch has (2.11 lacks it).
get_driver = getattr(torch._C, "_cuda_getDriverVersion", None)
driver = get_driver() if get_driver and torch.cuda.is_available() else "n/a"
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "driver supports cuda", driver)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
PY
command -v nvcc >/dev/null && nvcc --version | tail -1

step "carried wheels (no network)"
shopt -s nullglob
wheels=(wheels/*.whl .whl/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation "${wheels[@]}" \
    || status=1
  python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" || status=1
else
  echo "none (the DeepSpeed tests will skip): bash scripts/gpu_wheels.sh, then carry wheels/"
fi

step "build (editable, CUDA module for sm_90)"
python3 -m pip install -v --no-deps --no-build-isolation -e . >"$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
grep -E "deepcompile_remat: (CUDA|skipping)" "$OUT/build.log"
python3 -c "from deepcompile_remat import comm; print('cuda module built:', comm.cuda_available(), 'usable:', comm.cuda_usable()); print(comm.cuda_build_info())" || status=1

step "GPU tests (the CUDA cast kernel, single-GPU ZeRO-3, the NCCL path, DeepCompile on CUDA)"
python3 -m pytest -q -p no:cacheprovider tests/python/test_cast_ops.py \
  tests/python/test_cast_ops_gpu.py tests/python/test_zero3_gpu.py \
  tests/python/test_nccl_path.py tests/python/test_deepspeed.py::test_deepcompile_on_gpu_uses_our_partitioner \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -15
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "kernel benchmark"
python3 benchmarks/scripts/bench_allgather_cast.py --json "$OUT/bench_allgather_cast.json" \
  2>&1 | tail -40 || status=1

step "our cut against torch's, and the peak planner, at sequence 1024 on the GPU"
# No ZeRO-3, one process: the step's peak (the caching allocator's) and median time with torch's
# min-cut and with ours, then peak-target plans predicted against measured.
read -r -a cut_archs <<<"${DCR_GPU_CUT_ARCHS:-llama qwen2 gpt2 t5 convnext}"
python3 -m dcr_bench cut-quality --device cuda --scale 4 --steps 10 --archs "${cut_archs[@]}" \
  --precisions fp32 bf16 2>"$OUT/cut_quality.err" | tee "$OUT/cut_quality.txt" || status=1
tail -3 "$OUT/cut_quality.err"
read -r -a plan_archs <<<"${DCR_GPU_PLAN_ARCHS:-llama t5}"
python3 -m dcr_bench peak-plan --device cuda --scale 4 --steps 10 \
  --archs "${plan_archs[@]}" --precisions fp32 bf16 --targets 1.0 0.8 --out "$OUT/peak_plan" \
  2>"$OUT/peak_plan.err" || status=1
cat "$OUT/peak_plan/table.txt"; tail -3 "$OUT/peak_plan.err"

step "memory profile on the GPU (one GPU timed, per-rank memory at an emulated world of 8)"
# ~1 B parameters; DCR_GPU_PROFILE_ARGS overrides (e.g. a smaller model on a short lease).
read -r -a profile_args <<<"${DCR_GPU_PROFILE_ARGS:---layers 20 --hidden 2048 --heads 16 --vocab 32000 --seq 512}"
python3 -m dcr_bench profile --device cuda --world 1 --fake-world 8 "${profile_args[@]}" \
  --out "$OUT/profile" 2>"$OUT/profile.err" | tee "$OUT/profile_table.txt" || status=1
tail -5 "$OUT/profile.err"

step "the CPU tests that check this torch (gloo ranks, checkpointing, DeepSpeed, the partitioner)"
python3 -m pytest -q -p no:cacheprovider tests/python/test_checkpointing.py \
  tests/python/test_deepspeed.py tests/python/test_partition.py \
  -k "not bench and not model_gradients and not deepcompile_on_gpu" >"$OUT/cpu_tests.log" 2>&1 \
  || status=1
tail -15 "$OUT/cpu_tests.log"
exit $status
