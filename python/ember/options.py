"""Compile options: one validated dataclass shared by every entry point."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

_BACKENDS = ("cpu", "reference", "cuda-emu")
_FALLBACKS = ("eager", "error")
_EXPORTS = ("pt2", "onnx")


@dataclasses.dataclass(frozen=True)
class Options:
    """Options of ``ember.compile`` / ``torch.compile(..., options=...)``.

    backend: "cpu" (the fast CPU runtime), "reference" (the slow reference interpreter,
        for debugging numerics), or "cuda-emu" (the CUDA backend's generated kernels run on
        the host: slow, for testing CUDA code generation on machines without a GPU).
    device: "auto" (CUDA when the example inputs or the weights are CUDA tensors, else the
        CPU), "cpu" or "cuda" (the CUDA backend on GPU 0; a clear error where there is none).
    fallback: what to do with a graph Ember cannot compile: "eager" runs it with PyTorch and
        warns once naming the unsupported ops; "error" raises ``ember.UnsupportedOpError``.
    num_threads: worker threads of the CPU runtime (default: ``torch.get_num_threads()``).
    export: how a torch model reaches Ember: "pt2" (``torch.export``, weights bound by pointer)
        or "onnx" (``torch.onnx.export``, then the ONNX frontend; weights are copied into the
        ONNX model when the graph is compiled, so later in-place weight updates are not seen).
    search_iterations: candidate programs the optimizer measures at most (0 turns the
        optimizer off: the program runs as translated).
    time_budget_s: wall time the optimizer may spend measuring candidates.
    cache: reuse (and store) the optimizer's choice in the compile cache
        (``EMBER_CACHE_DIR``, default the user cache dir), so a second process skips search.
    quiet: no progress bar while the optimizer searches.
    seed: seeds the optimizer's random inputs and choices (same seed, same program).
    allow_tf32: the CUDA backend may multiply f32 matrices on TF32 tensor cores (inputs
        rounded to a 10-bit mantissa: faster, less exact, as
        ``torch.backends.cuda.matmul.allow_tf32``); off by default.
    """

    backend: str = "cpu"
    device: str = "auto"
    fallback: str = "eager"
    num_threads: int = 0
    export: str = "pt2"
    search_iterations: int = 8
    time_budget_s: float = 3.0
    cache: bool = True
    quiet: bool = False
    seed: int = 0
    allow_tf32: bool = False

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(
                f"ember option backend={self.backend!r}; valid: {', '.join(_BACKENDS)}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"ember option device={self.device!r}; valid: auto, cpu, cuda")
        if self.fallback not in _FALLBACKS:
            raise ValueError(
                f"ember option fallback={self.fallback!r}; valid: {', '.join(_FALLBACKS)}"
            )
        if self.export not in _EXPORTS:
            raise ValueError(f"ember option export={self.export!r}; valid: {', '.join(_EXPORTS)}")
        if self.num_threads < 0:
            raise ValueError(f"ember option num_threads={self.num_threads} must be >= 0")
        if self.search_iterations < 0:
            raise ValueError(
                f"ember option search_iterations={self.search_iterations} must be >= 0"
            )
        if not self.time_budget_s >= 0:
            raise ValueError(f"ember option time_budget_s={self.time_budget_s} must be >= 0")
        if self.seed < 0:
            raise ValueError(f"ember option seed={self.seed} must be >= 0")

    @property
    def threads(self) -> int:
        return self.num_threads or torch.get_num_threads()

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None) -> Options:
        options = dict(options or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in options.items():
            if key not in fields:
                raise ValueError(
                    f"Unsupported ember option {key!r}; valid: {', '.join(sorted(fields))}"
                )
            kind = str(fields[key].type)
            want = _TYPES[kind]
            ok = isinstance(value, want) and (kind == "bool" or not isinstance(value, bool))
            if not ok:
                raise TypeError(f"ember option {key!r} must be {kind}, got {type(value).__name__}")
            if kind == "float":
                options[key] = float(value)
        return cls(**options)

    def search_args(self, example_shapes: list[list[int]] | None) -> dict[str, Any]:
        """Keyword arguments of ``_core.compile`` that steer the optimizer."""
        return {
            "search_iterations": self.search_iterations,
            "time_budget_s": self.time_budget_s,
            "seed": self.seed,
            "input_shapes": example_shapes,
            "cache_dir": cache_dir() if self.cache else None,
            "allow_tf32": self.allow_tf32,
        }


# Option types as dataclasses record them (annotations are strings here); an int is a fine
# float, a bool is not an int.
_TYPES: dict[str, type | tuple[type, ...]] = {
    "int": int,
    "str": str,
    "bool": bool,
    "float": (int, float),
}


def cache_dir() -> str:
    """Where the compile cache lives: ``EMBER_CACHE_DIR``, else the user cache dir."""
    env = os.environ.get("EMBER_CACHE_DIR")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ember")
