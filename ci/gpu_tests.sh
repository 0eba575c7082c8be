#!/usr/bin/env bash
# GPU check, for any Linux machine with an NVIDIA GPU (and torch's CUDA build installed):
# installs Ember from a wheel built elsewhere (the first argument, or dist/ember-*.whl, made
# by `maturin build --release -o dist`), or builds one when there is none; runs every `cuda`
# test, the GPU benchmark of the small cases (SMALL_BENCH=0 skips it), and the
# ~1B-parameter llama decode/prefill benchmark (bounded by $LLAMA_TIMEOUT seconds, default
# 360; 0 skips it; LLAMA_ARGS are passed on, e.g. "--runners eager,ember,inductor-ro"),
# and a profile of Ember at those shapes (bench/gpu_profile.py, bounded by $PROFILE_TIMEOUT
# seconds, default 150; 0 skips it); transformers' generate with a static cache
# (bench/static_cache.py at Llama-3.2-1B's layer shape, 4 layers, bf16; $STATIC_TIMEOUT
# seconds, default 200; 0 skips it; $STATIC_RUNNERS, default eager,ember,inductor-ro);
# prints a short summary table last. Results also go to $OUT (or /tmp/ember-gpu).
# SANITIZE_TIMEOUT=N (seconds, default 0: skipped) also runs ci/gpu_sanitize.py (small
# llama prefill/decode, cuBLASLt and generated products) under compute-sanitizer's
# memcheck and racecheck, each bounded by N seconds.
#
# A lease-sized run (stop 35 on one H200: the 326 tests took 45 s on 14 workers, the llama
# bench with three runners 70 s; a fourth runner and the profile add about two minutes):
#   PYTEST_WORKERS=14 TEST_TIMEOUT=60 TESTS_TIMEOUT=200 MAXFAIL=500 SMALL_BENCH=0 \
#   LLAMA_TIMEOUT=300 LLAMA_ARGS="--runners eager,ember,inductor-ro,ember-cublaslt,ember-warp --repeats 10" \
#   ci/gpu_tests.sh
#
#   ci/gpu_tests.sh [path/to/ember-*.whl]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/ember-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

wheel=${1:-$(ls dist/ember-*.whl 2>/dev/null | head -n 1)}
if [ -n "$wheel" ]; then
    python3 -m pip install --quiet --no-deps --force-reinstall "$wheel" || exit 1
else
    python3 -m pip install --quiet --no-build-isolation . || exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 - <<'PY' | tee -a "$out/gpu.txt"
import ember
print("ember", ember.__version__, "cuda_built", ember.cuda_built(), "devices", ember.cuda.devices())
print("nvrtc", ember.cuda.nvrtc_version())
PY

# Run from a copy of the tests outside the source tree, so `import ember` finds the install.
# (Not under $out: only a few result files come back from there.)
tests=$(mktemp -d)/tests
cp -r tests "$tests"
# Where the plugins are installed: a test that hangs (a kernel that never ends) is stopped
# after $TEST_TIMEOUT s (default 120), and $PYTEST_WORKERS workers (default 4) share the
# compiles (NVRTC, torch.export) across the CPUs. TESTS_TIMEOUT=N bounds the whole run.
extra=()
python3 -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout="${TEST_TIMEOUT:-120}")
python3 -c "import xdist" 2>/dev/null && extra+=(-n "${PYTEST_WORKERS:-4}")
# SIGINT, so that pytest cut short still writes its summary and report.
timeout -s INT -k 30 "${TESTS_TIMEOUT:-0}" python3 -m pytest "$tests" -m cuda -q -p no:cacheprovider -rfEs --tb=short \
    --maxfail="${MAXFAIL:-60}" "${extra[@]}" --junitxml="$out/cuda-tests.xml" \
    2>&1 | tee "$out/cuda-tests.log"
tests_rc=${PIPESTATUS[0]}

bench_rc=0
if [ "${SMALL_BENCH:-1}" != 0 ]; then
    python3 -m bench.gpu --json "$out/gpu-bench.json" 2>&1 | tee "$out/gpu-bench.log"
    bench_rc=${PIPESTATUS[0]}
fi

llama_rc=0
if [ "${LLAMA_TIMEOUT:-360}" != 0 ]; then
    # shellcheck disable=SC2086  # LLAMA_ARGS is a list of arguments
    timeout "${LLAMA_TIMEOUT:-360}" python3 -m bench.gpu_llama --json "$out/gpu-llama.json" \
        ${LLAMA_ARGS:-} 2>&1 | tee "$out/gpu-llama.log"
    llama_rc=${PIPESTATUS[0]}
fi

profile_rc=0
if [ "${PROFILE_TIMEOUT:-150}" != 0 ]; then
    # Where Ember's time goes (kernels, graph replays and patches) at the llama shapes.
    timeout "${PROFILE_TIMEOUT:-150}" python3 -m bench.gpu_profile 2>&1 \
        | grep -v -E "USDT|FutureWarning|return cls" | tee "$out/gpu-profile.log"
    profile_rc=${PIPESTATUS[0]}
fi

static_rc=0
if [ "${STATIC_TIMEOUT:-200}" != 0 ]; then
    # transformers' generate with a StaticCache (caches updated in place), against eager
    # and Inductor's reduce-overhead (the mode transformers recommends with it).
    timeout "${STATIC_TIMEOUT:-200}" python3 -m bench.static_cache --device cuda --size 1b \
        --dtype bfloat16 --no-dynamic --lengths 1024 --tokens 32 \
        --runners "${STATIC_RUNNERS:-eager,ember,inductor-ro}" 2>&1 \
        | grep -v -E "Warning|warn|model.generate" | tee "$out/gpu-static-cache.log"
    static_rc=${PIPESTATUS[0]}
fi

sanitize_rc=0
if [ "${SANITIZE_TIMEOUT:-0}" != 0 ]; then
    sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
    for tool in memcheck racecheck; do
        timeout "$SANITIZE_TIMEOUT" "${sanitizer:-compute-sanitizer}" --tool "$tool" \
            --error-exitcode 1 --print-limit 20 python3 ci/gpu_sanitize.py \
            2>&1 | tee "$out/sanitize-$tool.log"
        rc=${PIPESTATUS[0]}
        echo "compute-sanitizer $tool exit $rc"
        [ "$rc" -eq 0 ] || sanitize_rc=$rc
    done
fi

echo
echo "== summary =="
head -n 1 "$out/gpu.txt"
python3 - "$out/cuda-tests.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

try:
    suite = ET.parse(sys.argv[1]).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    a = suite.attrib
    print(f"cuda tests: {a['tests']} run, {a['failures']} failed, {a['errors']} errors, "
          f"{a['skipped']} skipped")
except Exception as e:  # the summary must print even when pytest crashed
    print(f"cuda tests: no report ({e})")
PY
[ -f "$out/gpu-bench.log" ] && tail -n 12 "$out/gpu-bench.log"
[ -f "$out/gpu-llama.log" ] && grep -E '^(device|\|)' "$out/gpu-llama.log"
[ -f "$out/gpu-profile.log" ] && grep -E '^(==|ember \()' "$out/gpu-profile.log"
[ -f "$out/gpu-static-cache.log" ] && grep -E '^\|' "$out/gpu-static-cache.log"
[ -f "$out/sanitize-memcheck.log" ] && grep -h -E "ERROR SUMMARY|exit" "$out"/sanitize-*.log
echo "tests exit $tests_rc, bench exit $bench_rc, llama bench exit $llama_rc," \
    "profile exit $profile_rc, static cache exit $static_rc, sanitizer exit $sanitize_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$llama_rc" -eq 0 ] && [ "$profile_rc" -eq 0 ] \
    && [ "$static_rc" -eq 0 ] && [ "$sanitize_rc" -eq 0 ]
