"""The user-facing entry points: ``ember.compile`` and ``ember.compile_pt2``."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.utils._pytree as pytree

from ember import _core
from ember.compiled import CompiledModel
from ember.export import export_program, live_weights, save_bytes
from ember.options import Options


def compile(model: torch.nn.Module, *example_inputs: Any, **options: Any) -> CompiledModel:
    """Compiles ``model`` for inputs shaped like ``example_inputs``.

    The model is exported with ``torch.export``; its weights are bound once, by pointer
    (transposed weights of matrix products are pre-packed into one contiguous copy). In-place
    changes to the weights after compiling are seen: the next call binds them again.
    """
    opts = Options.from_dict(options)
    ep = export_program(model, example_inputs)
    program = _core.load_pt2(data=save_bytes(ep), load_weights=False)
    leaves = pytree.tree_leaves(example_inputs)
    shapes = [list(t.shape) for t in leaves if isinstance(t, torch.Tensor)]
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    return CompiledModel(
        program, opts, live_weights(ep), ep.call_spec.out_spec, shapes, example_inputs=tensors
    )


def compile_pt2(path: str | os.PathLike[str], **options: Any) -> CompiledModel:
    """Compiles a ``.pt2`` archive saved by ``torch.export.save``.

    Only the archive's JSON program and raw weight bytes are read; nothing in it is
    unpickled or executed, so archives from untrusted sources are safe to load.
    """
    opts = Options.from_dict(options)
    program = _core.load_pt2(path=os.fspath(path), load_weights=True)
    return CompiledModel(program, opts)
