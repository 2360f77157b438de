#!/usr/bin/env bash
# The test command: pytest (against the installed package) and the CTest conformance suite (C++,
# no Python in the code under test), from the build directory scripts/install.sh left behind.
# Tests marked slow (10 s or more each: routes of real workers, chaos, soaks, studies) are left out;
# `--slow` runs only them (CI runs both), `--all` everything. Other arguments go to pytest.
# Test files run on two pytest processes (pytest-xdist, a file's tests together so its module fixtures
# start once): most of a test's time is its workers' start-up, gRPC waits and one-thread steps, so a
# second file beside it nearly halves the lanes on 2 cores. LLAMA_SHARD_TEST_JOBS sets the count
# (1: one process, as before; more than 2 oversubscribes workers whose thread pools spin).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LANE=(-m "not slow")
RUN_CTEST=1
case "${1:-}" in
    --slow) LANE=(-m slow); RUN_CTEST=0; shift ;;
    --all)  LANE=(); shift ;;
esac
export LLAMA_SHARD_REQUIRE_MODEL=${LLAMA_SHARD_REQUIRE_MODEL:-1}
# tests import the installed package (python/ is not on sys.path). A pytest killed by a signal
# names the signal and the test it was running (tests/conftest.py writes it to this file). On two
# processes, xdist itself names the test of a worker that crashed, and fails it.
PROGRESS=$(mktemp)
trap 'rm -f "$PROGRESS"' EXIT
set +e
JOBS=${LLAMA_SHARD_TEST_JOBS:-$(( $(nproc) < 2 ? 1 : 2 ))}
"$PY" -c "import xdist" 2> /dev/null || JOBS=1  # an install without the test extras' pytest-xdist
PARALLEL=()
# (-p no:benchmark: a pytest-benchmark installed on the machine fails a parallel run with its warning)
[ "$JOBS" -le 1 ] || PARALLEL=(-n "$JOBS" --dist loadfile -p no:benchmark)
LLAMA_SHARD_TEST_PROGRESS="$PROGRESS" "$PY" -m pytest -q -p no:cacheprovider "${PARALLEL[@]}" "${LANE[@]}" tests "$@"
rc=$?
set -e
if [ "$rc" -gt 128 ]; then
    echo "test.sh: pytest was killed by signal $((rc - 128)) (SIG$(kill -l $((rc - 128)))) during $(cat "$PROGRESS")" >&2
fi
[ "$rc" -eq 0 ] || exit "$rc"
[ "$RUN_CTEST" -eq 1 ] || exit 0
build_dir=$("$PY" - <<'PY'
import glob, os
# the build scripts/install.sh left (build/<wheel tag>), not scripts/sanitize.sh's
dirs = [d for d in glob.glob("build/*") if os.path.isfile(os.path.join(d, "CTestTestfile.cmake"))
        and not os.path.basename(d).startswith("sanitize-")]
dirs.sort(key=lambda d: os.path.getmtime(os.path.join(d, "CMakeCache.txt")), reverse=True)
print(dirs[0] if dirs else "")
PY
)
if [ -z "$build_dir" ]; then
    echo "no CMake build directory under build/: run scripts/install.sh first" >&2
    exit 1
fi
ctest --test-dir "$build_dir" --output-on-failure
