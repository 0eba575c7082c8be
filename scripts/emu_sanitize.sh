#!/usr/bin/env bash
# Runs the CUDA backend's emulator tests with the generated kernels compiled under a
# sanitizer: `thread` finds data races between a block's threads (a missing __syncthreads
# or __syncwarp: what `compute-sanitizer --tool racecheck` finds on a GPU), `address`
# finds reads and writes outside a buffer (`--tool memcheck`). Without a GPU this is the
# check that a kernel which computes the right numbers on the emulator is also free of
# the races that would make it flaky on the GPU.
#
#   scripts/emu_sanitize.sh [thread|address] [test file...]   (default: every one of
#                                                              rust/cuda/tests)
#
# The test binaries are not instrumented; only the kernels are, and the sanitizer's
# runtime is preloaded. (Python cannot host it here: pyenv's interpreter crashes under a
# preloaded TSan, so the Python model tests are not run this way.)
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:-thread}
shift || true
case "$kind" in
thread) runtime=libtsan.so ;;
address) runtime=libasan.so ;;
*) echo "usage: $0 [thread|address] [test file...]" >&2; exit 2 ;;
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

# The test binaries of rust/cuda/tests (those named, or all).
binaries=$(cargo test -p ember-cuda --release --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json, sys
wanted = set(sys.argv[1:])
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    if "test" in m["target"]["kind"] and (not wanted or m["target"]["name"] in wanted):
        print(m["executable"])' "$@")
[ -n "$binaries" ] || { echo "no test binary named: $*" >&2; exit 2; }
status=0
for bin in $binaries; do
    echo "== $(basename "$bin") under the $kind sanitizer"
    LD_PRELOAD="$lib" "$bin" --test-threads 1 || status=1
done
if compgen -G "$log*" >/dev/null; then
    cat "$log"*
    echo "the $kind sanitizer reported problems in the generated kernels (above)" >&2
    status=1
fi
exit $status
