"""Compile options: one validated dataclass shared by every entry point."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

_BACKENDS = ("cpu", "reference")
_FALLBACKS = ("eager", "error")
_EXPORTS = ("pt2", "onnx")


@dataclasses.dataclass(frozen=True)
class Options:
    """Options of ``ember.compile`` / ``torch.compile(..., options=...)``.

    backend: "cpu" (the fast CPU runtime) or "reference" (the slow reference interpreter,
        for debugging numerics).
    fallback: what to do with a graph Ember cannot compile: "eager" runs it with PyTorch and
        warns once naming the unsupported ops; "error" raises ``ember.UnsupportedOpError``.
    num_threads: worker threads of the CPU runtime (default: ``torch.get_num_threads()``).
    export: how a torch model reaches Ember: "pt2" (``torch.export``, weights bound by pointer)
        or "onnx" (``torch.onnx.export``, then the ONNX frontend; weights are copied into the
        ONNX model when the graph is compiled, so later in-place weight updates are not seen).
    """

    backend: str = "cpu"
    fallback: str = "eager"
    num_threads: int = 0
    export: str = "pt2"

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(
                f"ember option backend={self.backend!r}; valid: {', '.join(_BACKENDS)}"
            )
        if self.fallback not in _FALLBACKS:
            raise ValueError(
                f"ember option fallback={self.fallback!r}; valid: {', '.join(_FALLBACKS)}"
            )
        if self.export not in _EXPORTS:
            raise ValueError(f"ember option export={self.export!r}; valid: {', '.join(_EXPORTS)}")
        if self.num_threads < 0:
            raise ValueError(f"ember option num_threads={self.num_threads} must be >= 0")

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
            want = int if fields[key].type == "int" else str
            if not isinstance(value, want) or isinstance(value, bool):
                raise TypeError(
                    f"ember option {key!r} must be {want.__name__}, got {type(value).__name__}"
                )
        return cls(**options)
