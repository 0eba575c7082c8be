"""Ember: a compiler that makes PyTorch models run faster for inference.

fast = torch.compile(model, backend="ember")
fast = ember.compile(model, *example_inputs)
fast = ember.compile_pt2("model.pt2")
runner = ember.compile_onnx("model.onnx")
"""

from ember import cuda
from ember._core import __version__
from ember.api import compile, compile_pt2
from ember.backend import ember_backend
from ember.compiled import CompiledModel
from ember.cuda import cuda_available, cuda_built
from ember.errors import (
    CompileError,
    EmberError,
    EmberRuntimeError,
    InputError,
    ShapeError,
    UnsupportedOpError,
)
from ember.onnx import OnnxModel, compile_onnx
from ember.options import Options
from ember.profile import CpuProfile, profile_cpu
from ember.report import Candidate, SearchReport, last_report

__all__ = [
    "Candidate",
    "CompileError",
    "CompiledModel",
    "CpuProfile",
    "EmberError",
    "EmberRuntimeError",
    "InputError",
    "OnnxModel",
    "Options",
    "SearchReport",
    "ShapeError",
    "UnsupportedOpError",
    "__version__",
    "compile",
    "cuda_available",
    "cuda_built",
    "compile_onnx",
    "compile_pt2",
    "cuda",
    "ember_backend",
    "last_report",
    "profile_cpu",
]
