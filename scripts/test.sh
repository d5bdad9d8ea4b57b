#!/usr/bin/env bash
# Runs every test: the GoogleTest suite (built here by CMake) and the pytest suite.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${DCR_TEST_BUILD_DIR:-build/cpp-tests}"
cmake -S . -B "$BUILD_DIR" -G Ninja -DDCR_BUILD_TESTS=ON -DDCR_BUILD_PYTHON=OFF \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD_DIR"
ctest --test-dir "$BUILD_DIR" --output-on-failure
python3 -m pytest tests "$@"
