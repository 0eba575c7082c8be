#!/usr/bin/env bash
# Installs Ember with its test dependencies and runs every test (Rust, then Python).
# This is the README's test command; .ci/run runs it too.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --upgrade pip
python3 -m pip install --quiet -e ".[test]"
cargo test --workspace --exclude ember-python --release --quiet
python3 -m ruff check python tests bench
python3 -m pytest -q -p no:cacheprovider
