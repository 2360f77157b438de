#!/usr/bin/env bash
# Runs the native code under sanitizers: bash scripts/sanitize.sh [address|thread]
#   address: AddressSanitizer + UndefinedBehaviorSanitizer; thread: ThreadSanitizer.
# Builds the engine, the Python module and the CTest suite with the sanitizer into a persistent
# build directory of its own (build/sanitize-<kind>), runs CTest and a pytest subset that drives the
# native code (bad input, the contract, batching, split parity, the warm tier, retries, the sampler; with
# address also the real-model threads tests) against that module, and fails on any report.
# Reports go to files in $BUILD/reports (pytest would swallow a report written to its captured
# stderr) and are printed at the end. ggml runs its own thread pool (no OpenMP), as in every build. The
# thread job leaves out tests marked `grpc` (gRPC's core is not built with ThreadSanitizer, so its
# own synchronization is invisible to it and it reports races inside gRPC) and the real-model
# tests (over 15 minutes under ThreadSanitizer); the engine's threads are the CTest stress test's.
set -euo pipefail
cd "$(dirname "$0")/.."
KIND=${1:-address}
shift || true  # the rest goes to pytest
PY=${PYTHON:-python3}
case "$KIND" in
    address) FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -O1"
             RUNTIME=$(gcc -print-file-name=libasan.so)
             SELECT=(-m "not model or real_model_threads") ;;
    thread)  FLAGS="-fsanitize=thread -fno-omit-frame-pointer -g -O1"
             RUNTIME=$(gcc -print-file-name=libtsan.so)
             SELECT=(-m "not model and not grpc") ;;
    *) echo "usage: $0 [address|thread]" >&2; exit 2 ;;
esac
BUILD=build/sanitize-$KIND
"$PY" -m pip install --quiet "pybind11>=2.12" "cmake>=3.21" ninja
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_FLAGS="$FLAGS" -DCMAKE_CXX_FLAGS="$FLAGS" -DCMAKE_EXE_LINKER_FLAGS="${FLAGS%% *}" \
    -DCMAKE_SHARED_LINKER_FLAGS="${FLAGS%% *}" -DPython_EXECUTABLE="$(command -v "$PY")" \
    -DLLAMA_SHARD_USE_OPENSSL=OFF > /dev/null  # the vendored SHA-256 (the default build takes OpenSSL's)
cmake --build "$BUILD" --target _native llama_shard_ctests
REPORTS="$PWD/$BUILD/reports"
rm -rf "$REPORTS" && mkdir -p "$REPORTS"
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1:log_path=$REPORTS/asan
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:log_path=$REPORTS/ubsan
# die_after_fork=0: the CPU self-check probes its kernels in a forked child that starts threads
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:die_after_fork=0:log_path=$REPORTS/tsan
reports() {  # prints every report written so far; fails if there is one
    if compgen -G "$REPORTS/*" > /dev/null; then
        cat "$REPORTS"/* >&2
        echo "sanitize.sh $KIND: reports above ($REPORTS)" >&2
        exit 1
    fi
}
trap reports EXIT
ctest --test-dir "$BUILD" --output-on-failure
# the module under test: this checkout's Python files with the sanitized extension beside them
PKG="$BUILD/pkg"
rm -rf "$PKG" && mkdir -p "$PKG" && cp -r python/llama_shard "$PKG/"
cp "$BUILD"/native/_native*.so "$PKG/llama_shard/"
# libstdc++ preloaded too: the sanitizer's __cxa_throw interceptor needs it when python itself does
# not link it. The lockstep state machine runs at a fifth of its usual size (2,000 operations).
# A pytest killed by a signal (an instruction the CPU refuses, a sanitizer that aborts) says so, with
# the test it was running (tests/conftest.py writes each test's id to LLAMA_SHARD_TEST_PROGRESS).
PROGRESS="$PWD/$BUILD/current-test"
rm -f "$PROGRESS"
set +e
LD_PRELOAD="$RUNTIME:$(g++ -print-file-name=libstdc++.so)" PYTHONPATH="$PKG" LLAMA_SHARD_LOCKSTEP_STEPS=2000 \
    LLAMA_SHARD_TEST_PROGRESS="$PROGRESS" "$PY" -m pytest -q -p no:cacheprovider -x \
    tests/test_bad_input.py tests/test_hot_kv_contract.py tests/test_batching.py tests/test_split_parity.py \
    tests/test_warm_tier.py tests/test_retry.py tests/test_hot_kv_statemachine.py tests/test_hot_kv_real_model.py \
    tests/test_cpu_self_check.py tests/test_sampling.py tests/test_prefixes.py \
    tests/test_speculation.py::test_a_step_with_several_logit_rows_gives_each_rows_one_token_logits \
    tests/test_speculation.py::test_the_reference_engine_returns_the_same_rows "${SELECT[@]}" "$@"
rc=$?
set -e
if [ "$rc" -gt 128 ]; then
    echo "sanitize.sh $KIND: pytest was killed by signal $((rc - 128)) (SIG$(kill -l $((rc - 128)))) during" \
         "$(cat "$PROGRESS" 2>/dev/null || echo "its start-up")" >&2
fi
[ "$rc" -eq 0 ] || { reports; exit "$rc"; }
trap - EXIT
reports
echo "sanitize.sh $KIND: no reports"
