"""Ember's exceptions. All derive from :class:`EmberError`; the classes are defined by the
native module so that Rust errors map onto them directly."""

from ember._core import (
    CompileError,
    EmberError,
    EmberRuntimeError,
    InputError,
    ShapeError,
    UnsupportedOpError,
)

__all__ = [
    "CompileError",
    "EmberError",
    "EmberRuntimeError",
    "InputError",
    "ShapeError",
    "UnsupportedOpError",
]
