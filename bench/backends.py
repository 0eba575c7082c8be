"""The compared backends. Each one turns (model, inputs) into a zero-argument callable that
runs the model once on those inputs and returns its outputs."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch import nn

from bench.generation import GenerationLoop


@dataclasses.dataclass
class Prepared:
    """A ready-to-time backend: ``call()`` runs the model once; ``note`` goes into the report."""

    call: Callable[[], Any]
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    prepare: Callable[[nn.Module, tuple[torch.Tensor, ...], int], Prepared]
    runs_generation: bool = False  # compiles a `GenerationLoop`'s forward


def flatten_outputs(out: Any) -> list[torch.Tensor]:
    """The output tensors in pytree order (ONNX Runtime's list of arrays becomes tensors)."""
    leaves = pytree.tree_leaves(out)
    return [torch.from_numpy(np.asarray(x)) if not torch.is_tensor(x) else x for x in leaves]


def _eager(model: nn.Module, inputs: tuple[torch.Tensor, ...], threads: int) -> Prepared:
    return Prepared(lambda: model(*inputs))


def _ember_with(**search: Any) -> Callable[[nn.Module, tuple[torch.Tensor, ...], int], Prepared]:
    """Ember with the given optimizer options (none: the defaults users get)."""

    def prepare(model: nn.Module, inputs: tuple[torch.Tensor, ...], threads: int) -> Prepared:
        import ember

        options = {"num_threads": threads, "quiet": True, **search}
        if isinstance(model, GenerationLoop):
            loop = model.with_forward(lambda f: torch.compile(f, backend="ember", options=options))
            return Prepared(lambda: loop(*inputs), note='torch.compile(forward, backend="ember")')
        compiled = ember.compile(model, *inputs, **options)
        return Prepared(lambda: compiled(*inputs))

    return prepare


def _inductor(model: nn.Module, inputs: tuple[torch.Tensor, ...], threads: int) -> Prepared:
    # Inductor compiles on the first call (the runner times that call as setup); its C++
    # kernels use torch's thread count at compile time, which the runner has already set.
    if isinstance(model, GenerationLoop):
        loop = model.with_forward(torch.compile)
        return Prepared(lambda: loop(*inputs))
    compiled = torch.compile(model)
    return Prepared(lambda: compiled(*inputs))


def _export_onnx(model: nn.Module, inputs: tuple[torch.Tensor, ...], path: str) -> str:
    """Exports with the dynamo exporter, or the legacy TorchScript one if that fails; returns
    which exporter was used (and why the first one failed)."""
    sink = io.StringIO()  # the exporters print progress; keep the benchmark log readable
    try:
        with contextlib.redirect_stdout(sink):
            torch.onnx.export(model, inputs, path, dynamo=True)
        return "dynamo exporter"
    except Exception as dynamo_error:
        reason = f"{type(dynamo_error).__name__}: {first_line(str(dynamo_error))}"
        try:
            with contextlib.redirect_stdout(sink):
                torch.onnx.export(model, inputs, path, dynamo=False)
        except Exception as legacy_error:
            raise RuntimeError(
                f"ONNX export failed (dynamo: {reason}; legacy: "
                f"{type(legacy_error).__name__}: {first_line(str(legacy_error))})"
            ) from legacy_error
        return f"legacy exporter (dynamo exporter failed: {reason})"


def _onnxruntime(model: nn.Module, inputs: tuple[torch.Tensor, ...], threads: int) -> Prepared:
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="ember-bench-") as tmp:
        path = os.path.join(tmp, "model.onnx")
        exporter = _export_onnx(model, inputs, path)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    if len(names) != len(inputs):
        raise RuntimeError(f"the ONNX model takes {len(names)} inputs, the model {len(inputs)}")
    feed = {name: x.detach().contiguous().numpy() for name, x in zip(names, inputs, strict=True)}
    return Prepared(lambda: session.run(None, feed), note=exporter)


def _ember_onnx(model: nn.Module, inputs: tuple[torch.Tensor, ...], threads: int) -> Prepared:
    """Ember on the ONNX file ONNX Runtime runs (``ember.compile_onnx``, numpy in and out)."""
    import ember

    with tempfile.TemporaryDirectory(prefix="ember-bench-") as tmp:
        path = os.path.join(tmp, "model.onnx")
        exporter = _export_onnx(model, inputs, path)
        runner = ember.compile_onnx(path, num_threads=threads, quiet=True)
    arrays = [x.detach().contiguous().numpy() for x in inputs]
    return Prepared(lambda: runner(*arrays), note=exporter)


EAGER = Backend("eager", _eager, runs_generation=True)
EMBER = Backend("Ember", _ember_with(), runs_generation=True)
# The optimizer's share: the program as translated (no e-graph, no search), and the
# e-graph's cost-model choice without measured search (no cache, so it is really chosen).
EMBER_UNOPTIMIZED = Backend(
    "Ember (unoptimized)", _ember_with(search_iterations=0), runs_generation=True
)
EMBER_COST_MODEL = Backend(
    "Ember (cost model)", _ember_with(search_iterations=1, cache=False), runs_generation=True
)
INDUCTOR = Backend("Inductor", _inductor, runs_generation=True)
ORT = Backend("ORT", _onnxruntime)
EMBER_ONNX = Backend("Ember (ONNX file)", _ember_onnx)


def backends(inductor: bool = True, optimizer: bool = True) -> Sequence[Backend]:
    """The backends in report order; eager comes first (it is the reference)."""
    chosen = [EAGER, EMBER, INDUCTOR, ORT, EMBER_ONNX]
    if not inductor:
        chosen.remove(INDUCTOR)
    if optimizer:
        chosen += [EMBER_UNOPTIMIZED, EMBER_COST_MODEL]
    return tuple(chosen)


def first_line(text: str, limit: int = 240) -> str:
    """The first non-empty line of an error message, shortened for a table cell."""
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"
