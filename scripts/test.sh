#!/usr/bin/env bash
# Installs Ember with its test dependencies and runs every test (Rust, then Python).
# This is the README's test command; .ci/run runs it too.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --upgrade pip
python3 -m pip install --quiet -e ".[test]"
cargo test --workspace --exclude ember-python --release --quiet
# The AVX2 GEMM tiles too on an AVX-512 machine (there they serve only one- and two-row
# tiles).
EMBER_CPU_AVX512=0 cargo test -p ember-cpu --lib --release --quiet sgemm
# The CUDA kernels at the GPU's launch sizes under the thread sanitizer: races between a
# block's threads (a missing __syncthreads) that the emulator's results alone may hide.
if [ -n "$(${CXX:-c++} -print-file-name=libtsan.so 2>/dev/null | grep /)" ]; then
    ./scripts/emu_sanitize.sh thread launch_sizes mma_attention
fi
# The product kernels' 16-byte loads of packed rows under the alignment check: an address
# x86 forgives and a GPU refuses ("misaligned address", which loses the CUDA context).
if [ -n "$(${CXX:-c++} -print-file-name=libubsan.so 2>/dev/null | grep /)" ]; then
    ./scripts/emu_sanitize.sh alignment products -- packed
fi
python3 -m ruff check python tests bench
# Two pytest workers (PYTEST_WORKERS): most of a test's time is compiling and checking, on
# one core, so two workers on two cores took the suite from 28 to 18 minutes.
python3 -m pytest -q -p no:cacheprovider -n "${PYTEST_WORKERS:-2}"
# The conv kernels AVX2-only CPUs pick (the AVX-512 ones take these shapes here), and the
# integer products and quantized convs they run without VNNI (f32 GEMMs over exact chunks).
EMBER_CPU_AVX512=0 python3 -m pytest -q -p no:cacheprovider tests/ops/test_conv.py -k cpu
EMBER_CPU_AVX512=0 python3 -m pytest -q -p no:cacheprovider tests/onnx/test_onnx_quant.py \
    tests/onnx/test_onnx_qoperator.py
# bf16 products on the FMA tiles that Intel CPUs without AMX run (AMX, or on AMD CPUs the
# vdpbf16ps tiles, take them by default).
EMBER_CPU_AMX=0 EMBER_CPU_BF16_PAIRS=0 python3 -m pytest -q -p no:cacheprovider tests/ops/test_linalg.py -k cpu
