"""The user-facing entry points: ``ember.compile`` and ``ember.compile_pt2``."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from ember import _core
from ember.compiled import CompiledModel, program_shape
from ember.export_cache import export
from ember.options import Options, cache_dir


class _Function(torch.nn.Module):
    """A plain function as a module, for ``torch.export`` (which takes modules only)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def compile(
    model: torch.nn.Module | Callable[..., Any], *example_inputs: Any, **options: Any
) -> CompiledModel:
    """Compiles ``model`` (a module or a function of tensors) for inputs shaped like
    ``example_inputs``.

    The model is exported with ``torch.export`` (or its export taken from the cache, see
    ``export_cache``); its weights are bound once, by pointer (transposed weights of matrix
    products are pre-packed into one contiguous copy). In-place changes to the weights after
    compiling are seen: the next call binds them again.
    """
    if not isinstance(model, torch.nn.Module):
        if not callable(model):
            raise TypeError(
                f"ember.compile takes an nn.Module or a function, not {type(model).__name__}"
            )
        model = _Function(model)
    opts = Options.from_dict(options)
    exported = export(model, example_inputs, cache_dir() if opts.cache else None)
    leaves = pytree.tree_leaves(example_inputs)
    shapes = [program_shape(t) for t in leaves if isinstance(t, torch.Tensor)]
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    return CompiledModel(
        exported.program,
        opts,
        exported.weights,
        exported.out_spec,
        shapes,
        example_inputs=tensors,
        export_cache_hit=exported.cache_hit,
    )


def compile_pt2(path: str | os.PathLike[str], **options: Any) -> CompiledModel:
    """Compiles a ``.pt2`` archive saved by ``torch.export.save``.

    Only the archive's JSON program and raw weight bytes are read; nothing in it is
    unpickled or executed, so archives from untrusted sources are safe to load.
    """
    opts = Options.from_dict(options)
    program = _core.load_pt2(path=os.fspath(path), load_weights=True)
    return CompiledModel(program, opts)
