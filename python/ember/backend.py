"""``torch.compile(model, backend="ember")``: the Dynamo backend.

Dynamo hands us an FX graph. We compile it lazily on the first call for each input
signature (shapes, dtypes, int arguments), through the same export path as
``ember.compile``. A graph with ops Ember does not support is split: its supported regions
are compiled, the rest runs eagerly, and one warning names the eager ops (``fallback="error"``
raises instead).
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ember.compiled import CompiledModel, program_shape
from ember.dynamo_graph import (
    DynamoGraph,
    lifted_scalars,
    split,
    weight_inputs,
    with_constants,
)
from ember.errors import InputError, UnsupportedOpError
from ember.export import dynamo_dynamic_shapes, export_onnx_bytes
from ember.export_cache import export
from ember.options import Options, cache_dir
from ember.partition import partition

_log = logging.getLogger("ember")


def _signature(args: Sequence[Any], positions: Sequence[int]) -> tuple[Any, ...]:
    """What a compiled program is specialized on: the shapes, dtypes and devices of the
    tensors it reads and the values of its other arguments (not the weights, whose shapes
    are part of the graph, nor ints that repeat a tensor's dim). Runs on every call."""
    return tuple(
        (a.shape, a.dtype, a.device) if isinstance(a, torch.Tensor) else (type(a), a)
        for a in (args[i] for i in positions)
    )


_programs_compiled = 0
# The programs the backend has built that are still in use (not the ONNX-export path's).
_live_programs: weakref.WeakSet[CompiledModel] = weakref.WeakSet()


def programs_compiled() -> int:
    """How many programs the torch.compile backend has compiled in this process (tests use it
    to prove Ember, not an eager fallback, ran a graph)."""
    return _programs_compiled


def live_programs() -> list[CompiledModel]:
    """The programs torch.compile(backend="ember") built that are still alive: what to ask
    for ``run_stats()``, ``report()`` or ``ir()`` of a model compiled through Dynamo (one
    per graph and input signature; more than one per model means graph breaks)."""
    return list(_live_programs)


class _DynamoGraph:
    """One Dynamo graph; compiled programs cached per input signature. ``split_unsupported``:
    whether a graph with unsupported ops is split into compiled regions and eager ops (off for
    the regions themselves, which run eagerly if they still fail)."""

    def __init__(
        self, gm: torch.fx.GraphModule, options: Options, split_unsupported: bool = True
    ) -> None:
        self.gm = gm
        self.options = options
        self.split_unsupported = split_unsupported
        self.warned = False
        # What is exported: sizes read from tensor shapes, only tensors returned.
        self.graph = split(gm)
        # A program with symbolic dims serves every size Dynamo made dynamic; the per-
        # signature programs cover what it cannot (sizes outside its range, static graphs).
        self.dynamic: Callable[..., Any] | None = None
        self.compiled: dict[tuple[Any, ...], Callable[..., Any]] = {}

    def _kept(self, args: Sequence[Any]) -> list[Any]:
        return [args[i] for i in self.graph.kept]

    def _tensor_positions(self, args: Sequence[Any]) -> list[int]:
        """Positions of the call's arguments that are the compiled program's inputs."""
        return [i for i in self.graph.kept if isinstance(args[i], torch.Tensor)]

    def _build(self, args: Sequence[Any], dynamic_shapes: Any) -> Callable[..., Any]:
        if self.options.export == "onnx":
            return self._build_onnx(args, dynamic_shapes)
        exported = export(
            self.graph.gm,
            self._kept(args),
            cache_dir() if self.options.cache else None,
            dynamic_shapes=dynamic_shapes,
        )
        tensor_positions = self._tensor_positions(args)
        tensors = [args[i] for i in tensor_positions]
        model = CompiledModel(
            exported.program,
            self.options,
            exported.weights,
            exported.out_spec,
            [program_shape(t) for t in tensors],
            example_inputs=tensors,
            export_cache_hit=exported.cache_hit,
        )
        global _programs_compiled
        _programs_compiled += 1
        _live_programs.add(model)
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
        tensor_positions = self._tensor_positions(args)
        runner = compile_with(data, self.options, [list(args[i].shape) for i in tensor_positions])
        global _programs_compiled
        _programs_compiled += 1

        def run(*call_args: Any) -> Any:
            outs = runner(*[call_args[i] for i in tensor_positions])
            return self.graph.rebuild(call_args, outs)

        return run

    def _compile(self, args: Sequence[Any]) -> Callable[..., Any]:
        spec = None
        if self.dynamic is None:
            # Dims Dynamo gave one symbol tied together first; each on its own if export
            # rejects that (see `dynamo_dynamic_shapes`), unless that is the same spec.
            tried: list[str] = []
            for tied in (True, False):
                spec = dynamo_dynamic_shapes(self.graph.gm, self._kept(args), tied=tied)
                if spec is None or repr(spec) in tried:
                    break
                tried.append(repr(spec))
                try:
                    self.dynamic = self._build(args, spec)
                    return self.dynamic
                except Exception as e:  # noqa: BLE001 - any failure: specialize instead
                    _log.debug("ember: symbolic compile (tied=%s) failed (%s)", tied, e)
        try:
            return self._build(args, None)
        except UnsupportedOpError as e:
            if self.options.fallback == "error":
                raise
            return self._fallback(args, spec, e)

    def _fallback(self, args: Sequence[Any], spec: Any, error: UnsupportedOpError) -> Any:
        """The graph split into regions Ember compiles and eager ops; the whole graph eager
        when even that fails. Warns once per graph."""
        if self.split_unsupported:
            for dynamic_shapes in [spec, None] if spec is not None else [None]:
                try:
                    parts = partition(
                        self.graph.gm,
                        self._kept(args),
                        dynamic_shapes,
                        lambda region: _DynamoGraph(region, self.options, split_unsupported=False),
                    )
                except Exception as e:  # noqa: BLE001 - any failure: the whole graph eagerly
                    _log.debug("ember: splitting the graph failed (%s)", e)
                    continue
                if not parts.unsupported:
                    # Every op is supported by name; one refused its particular arguments
                    # (the error says which): splitting would only compile the same refusal.
                    break
                self._warn(
                    f"ember: {', '.join(parts.unsupported)} not supported; running "
                    f"{'it' if len(parts.unsupported) == 1 else 'them'} eagerly and the "
                    f"rest of the graph as {parts.regions} compiled region(s)"
                )
                run_split = _split_runner(self.graph, parts.module)
                if dynamic_shapes is not None:
                    self.dynamic = run_split
                return run_split
        self._warn(
            f"ember: running this graph eagerly because it uses an op Ember does not "
            f"support: {error}"
        )
        return self.gm.forward

    def _warn(self, message: str) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(message, stacklevel=5)

    def __call__(self, *args: Any) -> Any:
        if self.dynamic is not None:
            try:
                return self.dynamic(*args)
            except InputError:
                pass  # a size outside the symbolic program's range: specialize below
        key = _signature(args, self.graph.kept)
        fn = self.compiled.get(key)
        if fn is None:
            fn = self._compile(args)
            self.compiled[key] = fn
        return fn(*args)


def _split_runner(graph: DynamoGraph, module: torch.fx.GraphModule) -> Callable[..., Any]:
    def run_split(*call_args: Any) -> Any:
        return graph.rebuild(call_args, module(*[call_args[i] for i in graph.kept]))

    return run_split


# Specialized graphs kept per Dynamo graph; each holds its weights alive.
_MAX_SPECIALIZED = 8


class _Specialized:
    """A Dynamo graph whose inputs include what Ember compiles as constants: lifted floats
    (see ``lifted_scalars``; by value) and module parameters and buffers (see
    ``weight_inputs``; by identity, so in-place updates are still seen). One graph per set
    of them, each built with constants in their place."""

    def __init__(
        self, gm: torch.fx.GraphModule, options: Options, scalars: list[int], weights: list[int]
    ) -> None:
        self.gm = gm
        self.options = options
        self.scalars = scalars
        self.weights = weights
        # key -> (graph, the weight tensors: held so that their ids stay theirs)
        self.graphs: dict[tuple[Any, ...], tuple[_DynamoGraph, list[Any]]] = {}

    def __call__(self, *args: Any) -> Any:
        values = tuple(args[i].item() for i in self.scalars)
        key = values + tuple(id(args[i]) for i in self.weights)
        entry = self.graphs.get(key)
        if entry is None:
            weights = {i: args[i] for i in self.weights}
            scalars = dict(zip(self.scalars, values, strict=True))
            graph = _DynamoGraph(with_constants(self.gm, scalars, weights), self.options)
            if len(self.graphs) >= _MAX_SPECIALIZED:
                # Weights replaced over and over (not updated in place): keep the newest.
                del self.graphs[next(iter(self.graphs))]
            entry = self.graphs[key] = (graph, list(weights.values()))
        return entry[0](*args)


def ember_backend(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None
) -> Callable[..., Any]:
    """The Dynamo backend registered as ``"ember"``."""
    del example_inputs  # compiled on first call, with real inputs
    opts = Options.from_dict(options)
    scalars, weights = lifted_scalars(gm), weight_inputs(gm)
    if scalars or weights:
        return _Specialized(gm, opts, scalars, weights)
    return _DynamoGraph(gm, opts)
