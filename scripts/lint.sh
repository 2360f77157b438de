#!/usr/bin/env bash
# The linter (ruff, configured in pyproject.toml): the package, tests, benchmarks and scripts.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m ruff check .
