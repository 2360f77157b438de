#!/usr/bin/env bash
# The linter and the formatter (ruff, configured in pyproject.toml): the package, tests, benchmarks
# and scripts. Fails on a lint finding or on a file the formatter would change (`ruff format` fixes it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m ruff check .
"$PY" -m ruff format --check .
