#!/usr/bin/env bash
# Runs the CUDA backend's emulator tests with the generated kernels compiled under a
# sanitizer: `thread` finds data races between a block's threads (a missing __syncthreads
# or __syncwarp: what `compute-sanitizer --tool racecheck` finds on a GPU), `address`
# finds reads and writes outside a buffer (`--tool memcheck`), `alignment` finds loads and
# stores at addresses their type does not allow (a 16-byte vector load at an address that
# is not a multiple of 16: x86 forgives it; a GPU stops with "misaligned address", and the
# CUDA context is lost for every later call). Without a GPU this is the check that a
# kernel which computes the right numbers on the emulator is also free of the faults that
# would make it flaky or fatal on the GPU.
#
#   scripts/emu_sanitize.sh [thread|address|alignment] [test...] [-- arguments...]
#
# A test is a test binary of rust/cuda/tests (by name; default: all of them) or, for
# `alignment`, a Python test file, directory or test id (run with pytest on the emulated
# backend alone): `scripts/emu_sanitize.sh alignment tests/cuda tests/models/test_models.py`.
# Arguments after `--` go to each test binary (a test name filter) or to pytest.
#
# The test binaries are not instrumented; only the kernels are, and the sanitizer's
# runtime is preloaded. (Python cannot host the thread sanitizer here: pyenv's
# interpreter crashes under a preloaded TSan; the undefined-behaviour runtime that checks
# alignment loads into it.)
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:-thread}
shift || true
case "$kind" in
thread) runtime=libtsan.so ;;
address) runtime=libasan.so ;;
alignment) runtime=libubsan.so ;;
*) echo "usage: $0 [thread|address|alignment] [test...]" >&2; exit 2 ;;
esac
lib=$(${CXX:-c++} -print-file-name="$runtime")
[ -f "$lib" ] || { echo "no $runtime for ${CXX:-c++}" >&2; exit 2; }

# A fresh kernel cache, so every module is compiled with the sanitizer.
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
log="$cache/sanitizer.log"
export EMBER_CACHE_DIR="$cache" EMBER_EMU_SANITIZE="$kind"
# Reports only from the kernels (the uninstrumented Rust test harness is not ours to
# check, and its channels look racy to a sanitizer that cannot see its atomics).
export TSAN_OPTIONS="ignore_noninstrumented_modules=1 halt_on_error=0 log_path=$log"
export ASAN_OPTIONS="detect_leaks=0 halt_on_error=1 log_path=$log"
export UBSAN_OPTIONS="halt_on_error=0 print_stacktrace=1 log_path=$log"

# Python tests named (paths), and the Rust test binaries named.
python_tests=()
rust_tests=()
extra=()
while [ $# -gt 0 ]; do
    t=$1
    shift
    if [ "$t" = "--" ]; then
        extra=("$@")
        break
    fi
    if [[ "$t" == *.py || "$t" == *.py::* || -d "$t" ]]; then
        python_tests+=("$t")
    else
        rust_tests+=("$t")
    fi
done
if [ ${#python_tests[@]} -gt 0 ] && [ "$kind" != alignment ]; then
    echo "only the alignment sanitizer runs Python tests" >&2
    exit 2
fi

# The test binaries of rust/cuda/tests (those named, or all where nothing is named).
binaries=""
if [ ${#rust_tests[@]} -gt 0 ] || [ ${#python_tests[@]} -eq 0 ]; then
    binaries=$(cargo test -p ember-cuda --release --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json, sys
wanted = set(sys.argv[1:])
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    if "test" in m["target"]["kind"] and (not wanted or m["target"]["name"] in wanted):
        print(m["executable"])' "${rust_tests[@]}")
    [ -n "$binaries" ] || { echo "no test binary named: ${rust_tests[*]}" >&2; exit 2; }
fi
status=0
if [ ${#python_tests[@]} -gt 0 ]; then
    echo "== ${python_tests[*]} (pytest, cuda-emu) under the $kind sanitizer"
    LD_PRELOAD="$lib" EMBER_TEST_BACKENDS=cuda-emu \
        python3 -m pytest -q -p no:cacheprovider "${python_tests[@]}" "${extra[@]}" || status=1
fi
for bin in $binaries; do
    echo "== $(basename "$bin") under the $kind sanitizer"
    LD_PRELOAD="$lib" "$bin" --test-threads 1 "${extra[@]}" || status=1
done
if compgen -G "$log*" >/dev/null; then
    cat "$log"*
    echo "the $kind sanitizer reported problems in the generated kernels (above)" >&2
    status=1
fi
exit $status
