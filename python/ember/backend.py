"""``torch.compile(model, backend="ember")``: the Dynamo backend.

Dynamo hands us an FX graph. We compile it lazily on the first call for each input
signature (shapes, dtypes, int arguments), through the same export path as
``ember.compile``. Graphs Ember cannot compile run eagerly with one warning (or raise,
with ``fallback="error"``).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ember import _core
from ember.compiled import CompiledModel
from ember.dynamo_graph import split
from ember.errors import InputError, UnsupportedOpError
from ember.export import (
    dynamo_dynamic_shapes,
    export_onnx_bytes,
    export_program,
    live_weights,
    save_bytes,
)
from ember.options import Options

_log = logging.getLogger("ember")


def _signature(args: Sequence[Any]) -> tuple[Any, ...]:
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((tuple(a.shape), a.dtype, a.device.type))
        else:
            key.append(("value", type(a).__name__, a))
    return tuple(key)


_programs_compiled = 0


def programs_compiled() -> int:
    """How many programs the torch.compile backend has compiled in this process (tests use it
    to prove Ember, not an eager fallback, ran a graph)."""
    return _programs_compiled


class _DynamoGraph:
    """One Dynamo graph; compiled programs cached per input signature."""

    def __init__(self, gm: torch.fx.GraphModule, options: Options) -> None:
        self.gm = gm
        self.options = options
        # What is exported: sizes read from tensor shapes, only tensors returned.
        self.graph = split(gm)
        # A program with symbolic dims serves every size Dynamo made dynamic; the per-
        # signature programs cover what it cannot (sizes outside its range, static graphs).
        self.dynamic: Callable[..., Any] | None = None
        self.compiled: dict[tuple[Any, ...], Callable[..., Any]] = {}

    def _kept(self, args: Sequence[Any]) -> list[Any]:
        return [args[i] for i in self.graph.kept]

    def _build(self, args: Sequence[Any], dynamic_shapes: Any) -> Callable[..., Any]:
        if self.options.export == "onnx":
            return self._build_onnx(args, dynamic_shapes)
        ep = export_program(self.graph.gm, self._kept(args), dynamic_shapes=dynamic_shapes)
        program = _core.load_pt2(data=save_bytes(ep), load_weights=False)
        shapes = [list(a.shape) for a in args if isinstance(a, torch.Tensor)]
        model = CompiledModel(
            program,
            self.options,
            live_weights(ep),
            ep.call_spec.out_spec,
            shapes,
            example_inputs=[a for a in args if isinstance(a, torch.Tensor)],
        )
        global _programs_compiled
        _programs_compiled += 1
        tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        if self.graph.exports_everything():

            def run(*call_args: Any) -> Any:
                return model(*[call_args[i] for i in tensor_positions])

            return run

        def run_rebuilt(*call_args: Any) -> Any:
            outs = model.run_flat([call_args[i] for i in tensor_positions])
            return self.graph.rebuild(call_args, outs)

        return run_rebuilt

    def _build_onnx(self, args: Sequence[Any], dynamic_shapes: Any) -> Callable[..., Any]:
        """The ``export="onnx"`` path: torch.onnx.export, then the ONNX frontend. ONNX
        outputs are flat; they are put back into the structure the graph returns."""
        from ember.onnx import compile_with

        data = export_onnx_bytes(self.graph.gm, self._kept(args), dynamic_shapes)
        shapes = [list(a.shape) for a in args if isinstance(a, torch.Tensor)]
        runner = compile_with(data, self.options, shapes)
        global _programs_compiled
        _programs_compiled += 1
        tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

        def run(*call_args: Any) -> Any:
            outs = runner(*[call_args[i] for i in tensor_positions])
            return self.graph.rebuild(call_args, outs)

        return run

    def _compile(self, args: Sequence[Any]) -> Callable[..., Any]:
        spec = None
        if self.dynamic is None:
            spec = dynamo_dynamic_shapes(self.graph.gm, self._kept(args))
        if spec is not None:
            try:
                self.dynamic = self._build(args, spec)
                return self.dynamic
            except Exception as e:  # noqa: BLE001 - any failure: specialize instead
                _log.debug("ember: symbolic compile failed (%s); specializing shapes", e)
        try:
            return self._build(args, None)
        except UnsupportedOpError as e:
            if self.options.fallback == "error":
                raise
            warnings.warn(
                f"ember: running this graph eagerly because it uses an op Ember does not "
                f"support: {e}",
                stacklevel=3,
            )
            return self.gm.forward

    def __call__(self, *args: Any) -> Any:
        if self.dynamic is not None:
            try:
                return self.dynamic(*args)
            except InputError:
                pass  # a size outside the symbolic program's range: specialize below
        key = _signature(args)
        fn = self.compiled.get(key)
        if fn is None:
            fn = self._compile(args)
            self.compiled[key] = fn
        return fn(*args)


def ember_backend(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None
) -> Callable[..., Any]:
    """The Dynamo backend registered as ``"ember"``."""
    del example_inputs  # compiled on first call, with real inputs
    return _DynamoGraph(gm, Options.from_dict(options))
