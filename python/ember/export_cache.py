"""The export cache: what ``torch.export`` made of a model, stored by the model's trace key
(``trace_key.model_key``), so a second process compiling the same model skips the export
(seconds: Dynamo's import and two traces) as the compile cache lets it skip the search.

An entry is one zip file under ``<cache dir>/exports/``: the exported program's JSON (all the
PT2 frontend reads when weights are bound by name), torch's output spec, and the export's
lifted constants that are not the model's own parameters or buffers. Weights are not stored:
a hit binds the model's current parameters and buffers by name, as a fresh export would.
Unreadable entries are misses; failures to write are ignored.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import zipfile
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from ember import _core
from ember.export import export_program, live_weights, prepare_graph_module, program_archive
from ember.trace_key import model_key

_log = logging.getLogger("ember")

_PROGRAM = "entry/models/model.json"
_META = "entry/ember/meta.json"
_CONSTANTS = "entry/ember/constants.pt"
# Lifted constants are stored in the entry (weights are not); an export whose constants are
# this large (tensors the model keeps as plain attributes) is not worth a disk copy.
_MAX_CONSTANT_BYTES = 256 << 20


@dataclasses.dataclass
class Exported:
    """A translated program and what it binds: weights by name and the output structure."""

    program: Any
    weights: dict[str, torch.Tensor]
    out_spec: Any
    cache_hit: bool = False


def export(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    cache_dir: str | None,
    dynamic_shapes: Any = None,
) -> Exported:
    """``model`` exported (with ``dynamic_shapes``) and translated; from the cache under
    ``cache_dir`` when an entry for its trace key is there (None: no cache)."""
    prepare_graph_module(model)
    key = None
    if cache_dir is not None:
        key = model_key(model, example_inputs, extra=f"dynamic_shapes {dynamic_shapes!r}")
    if key is not None and cache_dir is not None:
        hit = _load(_entry_path(cache_dir, key), model)
        if hit is not None:
            return hit
    ep = export_program(model, example_inputs, dynamic_shapes=dynamic_shapes)
    archive = program_archive(ep)
    program = _core.load_pt2(data=archive, load_weights=False)
    exported = Exported(program, live_weights(ep), ep.call_spec.out_spec)
    if key is not None and cache_dir is not None:
        _store(_entry_path(cache_dir, key), archive, exported, model)
    return exported


def _entry_path(cache_dir: str, key: str) -> str:
    return os.path.join(cache_dir, "exports", f"{key}.zip")


def _model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(model.named_buffers(remove_duplicate=False))
    return state


def _program_json(archive: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        names = [n for n in z.namelist() if n.endswith("/models/model.json") and n.count("/") == 2]
        if len(names) != 1:
            raise ValueError("the archive has no single <name>/models/model.json")
        return z.read(names[0])


def _store(path: str, archive: bytes, exported: Exported, model: torch.nn.Module) -> None:
    state = _model_state(model)
    constants = {
        name: t for name, t in exported.weights.items() if name not in state or state[name] is not t
    }
    size = sum(t.numel() * t.element_size() for t in constants.values())
    if size > _MAX_CONSTANT_BYTES:
        _log.debug("ember: not caching an export with %d bytes of constants", size)
        return
    # Compact copies: torch.save of a view would write its whole storage.
    constants = {name: t.detach().clone() for name, t in constants.items()}
    try:
        meta = {"out_spec": pytree.treespec_dumps(exported.out_spec)}
        constants_bytes = io.BytesIO()
        torch.save(constants, constants_bytes)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with zipfile.ZipFile(tmp, "w") as z:
            z.writestr(_PROGRAM, _program_json(archive))
            z.writestr(_META, json.dumps(meta))
            z.writestr(_CONSTANTS, constants_bytes.getvalue())
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 - a cache that cannot be written costs a re-export
        _log.debug("ember: not storing the export in the cache: %s", e)


def _load(path: str, model: torch.nn.Module) -> Exported | None:
    if not os.path.exists(path):
        return None
    try:
        with zipfile.ZipFile(path) as z:
            program_json = z.read(_PROGRAM)
            meta = json.loads(z.read(_META))
            constants = torch.load(io.BytesIO(z.read(_CONSTANTS)), weights_only=True)
        archive = io.BytesIO()
        with zipfile.ZipFile(archive, "w") as z:
            z.writestr(_PROGRAM, program_json)
        program = _core.load_pt2(data=archive.getvalue(), load_weights=False)
        out_spec = pytree.treespec_loads(meta["out_spec"])
    except Exception as e:  # noqa: BLE001 - an unreadable entry is a miss
        _log.debug("ember: unreadable export-cache entry %s: %s", path, e)
        return None
    state = _model_state(model)
    weights: dict[str, torch.Tensor] = {}
    for name, _, _ in program.weight_specs:
        t = state.get(name)
        if t is None:
            t = constants.get(name)
        if t is None:
            _log.debug("ember: export-cache entry %s binds %r, which is missing", path, name)
            return None
        weights[name] = t
    return Exported(program, weights, out_spec, cache_hit=True)
