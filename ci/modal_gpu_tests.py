"""Runs ci/gpu_tests.sh on a Modal GPU, for CI services that have none:

    modal run ci/modal_gpu_tests.py --gpu H100

The image has torch's CUDA build and the test dependencies; the repository (with a wheel
in dist/, if one was built) is copied in, and the script builds Ember there when there is
no wheel.
"""

from __future__ import annotations

import pathlib
import subprocess

import modal

ROOT = pathlib.Path(__file__).resolve().parent.parent

image = (
    modal.Image.debian_slim(python_version="3.11")
    .apt_install("curl", "build-essential")
    .run_commands("curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal")
    .env({"PATH": "/root/.cargo/bin:$PATH"})
    .pip_install("torch>=2.11", "numpy", "tqdm", "pytest", "maturin>=1.5,<2")
    .add_local_dir(ROOT, "/ember", ignore=["target", ".git", "**/__pycache__", ".venv"])
)
app = modal.App("ember-gpu-tests")


@app.function(image=image, timeout=3600)
def run_gpu_tests() -> int:
    return subprocess.call(["bash", "ci/gpu_tests.sh"], cwd="/ember")


@app.local_entrypoint()
def main(gpu: str = "H100") -> None:
    rc = run_gpu_tests.with_options(gpu=gpu).remote()
    if rc != 0:
        raise SystemExit(f"ci/gpu_tests.sh failed on {gpu} (exit {rc})")
