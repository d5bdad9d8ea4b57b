#!/usr/bin/env bash
# Runs every test: the GoogleTest suite (built here by CMake) and the pytest suite.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${DCR_TEST_BUILD_DIR:-build/cpp-tests}"
cmake -S . -B "$BUILD_DIR" -G Ninja -DDCR_BUILD_TESTS=ON -DDCR_BUILD_PYTHON=OFF \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD_DIR"
ctest --test-dir "$BUILD_DIR" --output-on-failure
# Two pytest workers, one test file at a time each (a file's rank processes and module
# fixtures stay in one worker): 18-19.5 min against 20.5 sequential on the 2-core machine
# (benchmarks/README.md, "The test suite's time"). DCR_TEST_WORKERS=0: sequential.
python3 -m pytest tests -n "${DCR_TEST_WORKERS:-2}" --dist loadfile "$@"
