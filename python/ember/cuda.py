"""CUDA support: finding the CUDA libraries, and what works without a GPU.

The extension loads libcuda, libnvrtc, libcublasLt and libcublas at run time (nothing is
linked), so the same wheel runs on machines with and without CUDA. The libraries are found where
torch's CUDA wheels put them (the ``nvidia`` packages) or in a CUDA toolkit
(``CUDA_HOME``/``CUDA_PATH``); loading them here, once, lets the extension find them by name.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from typing import Any

import torch

from ember import _core

# Loaded before the libraries that depend on them.
_LIBRARIES = ("libnvrtc-builtins.so*", "libnvrtc.so*", "libcublas.so*", "libcublasLt.so*")


def _library_dirs() -> list[str]:
    dirs: list[str] = []
    try:
        import nvidia  # the namespace package of torch's CUDA wheels

        for root in nvidia.__path__:
            dirs += sorted(glob.glob(os.path.join(root, "*", "lib")))
            dirs += sorted(glob.glob(os.path.join(root, "*", "*", "lib")))
    except ImportError:
        pass
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            dirs += [os.path.join(os.environ[var], "lib64"), os.path.join(os.environ[var], "lib")]
    return [d for d in dirs if os.path.isdir(d)]


@functools.cache
def load_libraries() -> list[str]:
    """Loads the CUDA libraries Ember uses (once); returns the paths loaded."""
    loaded: list[str] = []
    for pattern in _LIBRARIES:
        for d in _library_dirs():
            candidates = sorted(glob.glob(os.path.join(d, pattern)), key=len)
            if not candidates:
                continue
            try:
                ctypes.CDLL(candidates[0], mode=ctypes.RTLD_GLOBAL)
                loaded.append(candidates[0])
                break
            except OSError:
                continue
    return loaded


def cuda_built() -> bool:
    """Whether this build of Ember has the CUDA backend."""
    return bool(getattr(_core, "cuda_built", False))


def nvrtc_version() -> tuple[int, int] | None:
    """NVRTC's version, or None when libnvrtc cannot be loaded."""
    if not cuda_built():
        return None
    load_libraries()
    return _core.nvrtc_version()


def generated_source(program: Any, choice: str | None = None) -> dict[str, Any]:
    """The CUDA source Ember generates for a translated program (``_core.Program``):
    ``{"source": str, "kernels": [names], "steps": int}``. ``choice`` names a kernel the
    optimizer may choose (``"cuda.warp_dot"``, ``"cuda.thread_dot"``): the source is then
    generated as if it had been chosen wherever it applies."""
    if not cuda_built():
        raise RuntimeError("this build of Ember has no CUDA backend")
    return _core.cuda_codegen(program, choice)


def nvrtc_compile(source: str, arch: str = "sm_90") -> int:
    """Compiles CUDA source to CUBIN for ``arch`` with NVRTC; returns the CUBIN's size."""
    load_libraries()
    return _core.nvrtc_compile(source, arch)


def devices() -> list[tuple[str, str]]:
    """The GPUs a working CUDA driver reports, as ``(name, "sm_XX")``."""
    if not cuda_built():
        return []
    load_libraries()
    return _core.cuda_devices()


def product_tuning() -> list[dict[str, Any]]:
    """The matrix-product shapes measured on the GPU so far (each new shape's cuBLASLt
    algorithms and cuBLAS timed, the fastest kept): ``{"product": str, "candidates":
    [(name, median µs or None when it failed)], "chosen": name}``, oldest first. Empty
    without a GPU or before the first product ran."""
    if not cuda_built():
        return []
    return _core.cuda_product_tuning()


def cuda_available() -> bool:
    """Whether a usable NVIDIA GPU and driver are present (and Ember has the CUDA backend)."""
    return bool(devices())


def resolve_device(option: str, tensors: list[torch.Tensor]) -> str:
    """The device a program runs on: the option, or for "auto" CUDA when any of the
    example inputs or weights is a CUDA tensor. Raises clearly when CUDA cannot run."""
    device = option
    if option == "auto":
        device = "cuda" if any(t.device.type == "cuda" for t in tensors) else "cpu"
    if device == "cuda":
        if not cuda_built():
            raise RuntimeError("this build of Ember has no CUDA backend")
        if not cuda_available():
            raise RuntimeError(
                'device="cuda" was requested, but no usable NVIDIA GPU and driver were found '
                "(ember.cuda_available() is False)"
            )
    return device
