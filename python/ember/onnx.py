"""``ember.compile_onnx``: compile an ONNX model (a path, bytes or an ``onnx.ModelProto``).

The model is decoded and translated in Rust (nothing in it is executed); initializers become
weights owned by the compiled program. The returned :class:`OnnxModel` takes numpy arrays or
torch tensors, positionally or by input name, and returns the graph's outputs in order:
numpy in → numpy out, torch in → torch out. On ``device="cuda"`` host inputs are copied to
the GPU and numpy outputs back; torch tensors come back on the GPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ember import _core
from ember.compiled import _TORCH_TO_NUMPY, CompiledModel
from ember.errors import CompileError, InputError
from ember.options import Options

_NUMPY_DTYPES = set(_TORCH_TO_NUMPY.values())


# The oldest ai.onnx opset the Rust frontend reads; older models are upgraded first.
MIN_OPSET = 13


def load_program(model: Any) -> Any:
    """Translates ``model`` into an (uncompiled) ``_core.Program``. A model of an ai.onnx
    opset older than 13 is first converted to opset 13 by ``onnx.version_converter`` (when
    the ``onnx`` package is installed), as ONNX Runtime runs old models too."""
    try:
        return _load(model)
    except CompileError as error:
        upgraded = _upgraded(model, error)
        if upgraded is None:
            raise
        return _core.load_onnx(data=upgraded)


def _upgraded(model: Any, error: CompileError) -> bytes | None:
    """``model`` converted to opset 13 when it is older, else None. Conversion failures
    raise ``CompileError`` naming the converter's complaint."""
    # Only the frontend's opset refusal is worth a second parse of the model (other compile
    # errors of a large model would pay for it for nothing).
    if "is not supported: Ember reads ai.onnx opsets" not in str(error):
        return None
    try:
        import onnx
        from onnx import version_converter
    except ImportError:
        return None
    try:
        if isinstance(model, (str, os.PathLike)):
            # External data stays unread: Ember's own reader checks where it may come from.
            proto = onnx.load(os.fspath(model), load_external_data=False)
        elif isinstance(model, (bytes, bytearray, memoryview)):
            proto = onnx.load_from_string(bytes(model))
        elif isinstance(model, onnx.ModelProto):
            proto = model
        else:
            return None
    except Exception:  # not decodable by onnx either: the original error says why
        return None
    opsets = [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")]
    if not opsets or max(opsets) >= MIN_OPSET:
        return None
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
        raise CompileError(
            f"ONNX opset {max(opsets)} is older than Ember reads ({MIN_OPSET} to 25) and the "
            "model keeps its weights in external data, which Ember does not convert: convert "
            f"it with onnx.version_converter.convert_version(model, {MIN_OPSET}) and save it"
        ) from error
    try:
        converted = version_converter.convert_version(proto, MIN_OPSET)
        return converted.SerializeToString()
    except Exception as convert_error:
        raise CompileError(
            f"ONNX opset {max(opsets)} is older than Ember reads ({MIN_OPSET} to 25), and "
            f"onnx.version_converter could not convert it to {MIN_OPSET}: {convert_error}"
        ) from error


def _load(model: Any) -> Any:
    if isinstance(model, (str, os.PathLike)):
        return _core.load_onnx(path=os.fspath(model))
    if isinstance(model, (bytes, bytearray, memoryview)):
        return _core.load_onnx(data=bytes(model))
    if type(model).__name__ == "ModelProto" and hasattr(model, "SerializeToString"):
        return _core.load_onnx(data=model.SerializeToString())
    raise TypeError(
        f"compile_onnx expects a path, bytes or an onnx.ModelProto, got {type(model).__name__}"
    )


class OnnxModel:
    """An ONNX model compiled by Ember. Call it with the graph's inputs."""

    def __init__(self, compiled: CompiledModel) -> None:
        self._compiled = compiled
        self.input_names: list[str] = list(compiled.input_names)
        self.output_names: list[str] = list(compiled.output_names)
        self.input_dtypes: list[str] = list(compiled._input_dtypes)

    @property
    def device(self) -> str:
        """Where it runs: "cpu" or "cuda"."""
        return self._compiled.device

    def ir(self) -> str:
        """The compiled IR graph as text."""
        return self._compiled.ir()

    def _order(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
        """Inputs in graph order, from positional and named arguments."""
        names = self.input_names
        if len(args) > len(names):
            raise InputError(
                f"the model takes {len(names)} inputs ({', '.join(names)}), got {len(args)}"
            )
        values: dict[str, Any] = dict(zip(names, args, strict=False))
        for key, value in kwargs.items():
            if key not in names:
                raise InputError(f"unknown input {key!r}; the model's inputs are {names}")
            if key in values:
                raise InputError(f"input {key!r} was given twice")
            values[key] = value
        missing = [n for n in names if n not in values]
        if missing:
            raise InputError(f"missing inputs {missing}; the model's inputs are {names}")
        return [values[n] for n in names]

    def __call__(self, *args: Any, **kwargs: Any) -> list[Any]:
        # All inputs positional (the common case) skips the name matching.
        if kwargs or len(args) != len(self.input_names):
            args = tuple(self._order(args, kwargs))
        tensors = []
        numpy_in = not args
        for x, name in zip(args, self.input_names, strict=True):
            if isinstance(x, torch.Tensor):
                tensors.append(x)
            elif isinstance(x, np.ndarray):
                tensors.append(_from_numpy(x, name))
                numpy_in = True
            else:
                raise InputError(
                    f"input {name!r} must be a numpy array or a torch tensor, got {type(x)}"
                )
        if self._compiled.device == "cuda":
            tensors = [t.to("cuda", non_blocking=True) for t in tensors]
        # numpy in → numpy out (a model with no inputs returns numpy too).
        if numpy_in:
            return self._compiled.run_numpy(tensors)
        return self._compiled.run_flat(tensors)


def _from_numpy(x: np.ndarray, name: str) -> torch.Tensor:
    if x.dtype not in _NUMPY_DTYPES:
        raise InputError(f"input {name!r} has dtype {x.dtype}, which Ember does not support")
    # torch.from_numpy shares memory but refuses negative strides.
    if not x.flags.c_contiguous and any(s < 0 for s in x.strides):
        x = np.ascontiguousarray(x)
    return torch.from_numpy(x)


def compile_onnx(model: Any, device: str = "cpu", **options: Any) -> OnnxModel:
    """Compiles an ONNX model for ``device`` ("cpu" or "cuda"; the weights are uploaded to
    the GPU once).

    ``model`` is a path (external-data files are read from its folder; locations that leave
    the folder are refused), serialized bytes, or an ``onnx.ModelProto``.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"compile_onnx device={device!r}; valid: cpu, cuda")
    return compile_with(model, Options.from_dict({**options, "device": device}))


def compile_with(
    model: Any, options: Options, example_shapes: list[list[int]] | None = None
) -> OnnxModel:
    """``compile_onnx`` with validated options; ``example_shapes`` (the input shapes of a
    first call, when known) let the optimizer measure programs with symbolic dims."""
    program = load_program(model)
    return OnnxModel(CompiledModel(program, options, example_shapes=example_shapes))
