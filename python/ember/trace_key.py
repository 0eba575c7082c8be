"""What identifies a model's export without exporting it: the torch calls one eager run makes.

torch.export costs seconds in every process (it imports Dynamo, then traces the model), so
the export cache needs a key it can compute in milliseconds. ``model_key`` runs the model
once, on clones of the example inputs, under a ``TorchFunctionMode`` that records every torch
call: tensors by where they come from (an input, a parameter or buffer by name, an earlier
call's output, or a tensor made outside the run by its value) and every other argument by
value. The run sets the flags torch.export's tracing sets (``torch.compiler.is_compiling()``,
``is_exporting()``), so Python control flow takes the branches the export takes; two runs
with the same record then perform the same computation on weights of the same names, shapes
and dtypes, which is what the exported program is a function of (together with torch, Ember
and the model's source files, which the key also names).

Some models cannot be keyed this way; ``model_key`` then returns None and the model is
exported as usual: values read back into Python (``item()``, ``bool`` of a tensor: control
flow on data, which torch.export specializes or rejects), arguments of types the record does
not know, and in-place writes to parameters or buffers, which are refused before they run,
so computing a key never changes the model.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from ember import _core

_log = logging.getLogger("ember")

# Bump when the record's format changes: keys of older records must not match.
_FORMAT = "ember-trace-key 1"

# Tensor methods that hand values to Python (data-dependent control flow or printing).
_READS_VALUES = frozenset(
    [
        "item",
        "tolist",
        "numpy",
        "__bool__",
        "__int__",
        "__float__",
        "__complex__",
        "__index__",
        "__array__",
        "__repr__",
        "__str__",
        "__format__",
        "__reduce_ex__",
        "__contains__",
        "equal",
        "allclose",
        "is_nonzero",
    ]
)
_IN_PLACE_DUNDERS = frozenset(
    [
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
        "__imatmul__",
        "__setitem__",
        "__set__",
    ]
)


class _Unkeyable(Exception):
    """The run did something the record cannot vouch for; the message says what."""


def _func_name(func: Callable[..., Any]) -> str:
    """A stable name for a torch function, method or attribute access."""
    owner = getattr(func, "__self__", None)
    if owner is not None and hasattr(owner, "__objclass__"):
        # `tensor.shape` arrives as the getset descriptor's __get__.
        return f"{owner.__objclass__.__qualname__}.{owner.__name__}.{func.__name__}"
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    if qualname is None:
        raise _Unkeyable(f"a call of {func!r}, which has no name")
    name = f"{getattr(func, '__module__', None)}.{qualname}"
    if "<locals>" in qualname:
        # Functions made by a factory (torch's `boolean_dispatch` makes max_pool1d/2d/3d)
        # share a qualname; what they close over tells them apart.
        cells = getattr(func, "__closure__", None) or ()
        parts = [
            _func_name(c.cell_contents) if callable(c.cell_contents) else _scalar(c.cell_contents)
            for c in cells
        ]
        name += "[" + ",".join(parts) + "]"
    return name


def _method_name(func: Callable[..., Any]) -> str:
    owner = getattr(func, "__self__", None)
    if owner is not None and hasattr(owner, "__objclass__"):
        return func.__name__  # "__get__" / "__set__"
    return getattr(func, "__name__", "")


@functools.lru_cache(maxsize=256)
def _inplace_position(func: Callable[..., Any]) -> int | None:
    """The position of a Python function's ``inplace`` parameter (``F.relu(x, True)``)."""
    code = getattr(func, "__code__", None)
    if code is None:
        return None
    names = code.co_varnames[: code.co_argcount]
    return names.index("inplace") if "inplace" in names else None


def _scalar(v: Any) -> str:
    if v is None or isinstance(v, (bool, int, float, complex, str)):
        return f"{type(v).__name__}:{v!r}"
    if v is Ellipsis:
        return "..."
    if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return f"{type(v).__name__}:{v}"
    raise _Unkeyable(f"an argument of type {type(v).__qualname__}")


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


class _Recorder(TorchFunctionMode):
    """Records each torch call of one run as a line of text."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.refs: dict[int, str] = {}
        # Tensors named by id must stay alive, or a new tensor could reuse an id.
        self.alive: list[Any] = []
        self.protected: set[int] = set()
        for kind, named in (
            ("param", model.named_parameters(remove_duplicate=False)),
            ("buffer", model.named_buffers(remove_duplicate=False)),
        ):
            for name, t in named:
                if id(t) not in self.refs:
                    self.refs[id(t)] = f"{kind}:{name}"
                    self.alive.append(t)
                self.lines.append(f"{kind} {name} {self._meta(t)} = {self.refs[id(t)]}")
                storage = _storage(t)
                if storage is not None:
                    self.protected.add(storage)

    @staticmethod
    def _meta(t: torch.Tensor) -> str:
        return f"{t.dtype}{list(t.shape)}{list(t.stride())}@{t.device}"

    def input_clone(self, i: int, arg: Any) -> Any:
        """A copy of example input ``i`` (tensors cloned, so the run cannot change the
        caller's), its tensors named by position and its other values recorded."""
        leaves, spec = pytree.tree_flatten(arg)
        copies = []
        for j, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                leaf = leaf.detach().clone()
                self.refs[id(leaf)] = f"in{i}.{j}"
                self.alive.append(leaf)
                self.lines.append(f"input {i}.{j} {self._meta(leaf)}")
            else:
                self.lines.append(f"input {i}.{j} {self.value(leaf)}")
            copies.append(leaf)
        self.lines.append(f"input {i} {spec}")
        return pytree.tree_unflatten(copies, spec)

    def value(self, v: Any) -> str:
        if isinstance(v, torch.Tensor):
            ref = self.refs.get(id(v))
            return ref if ref is not None else self._outside(v)
        if isinstance(v, torch.Size):
            return f"Size{list(v)}"
        if isinstance(v, (tuple, list)):
            inner = ",".join(self.value(x) for x in v)
            return f"{type(v).__name__}({inner})"
        if isinstance(v, dict):
            items = sorted((str(k), self.value(x)) for k, x in v.items())
            return "{" + ",".join(f"{k}:{x}" for k, x in items) + "}"
        if isinstance(v, slice):
            return f"slice({self.value(v.start)},{self.value(v.stop)},{self.value(v.step)})"
        return _scalar(v)

    def _outside(self, t: torch.Tensor) -> str:
        """A tensor made before the run (an attribute that is not a buffer, a global): the
        export embeds its value, so the key holds the value's hash."""
        try:
            data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        except (RuntimeError, TypeError) as e:
            raise _Unkeyable(f"a tensor whose bytes cannot be read ({e})") from None
        digest = hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()
        ref = f"const:{self._meta(t)}:{digest}"
        self.refs[id(t)] = ref
        self.alive.append(t)
        return ref

    def _writes_state(self, func: Callable[..., Any], args: Sequence[Any], kwargs: dict) -> bool:
        """Whether the call writes in place to a parameter's or buffer's memory."""
        name = _method_name(func)
        position = _inplace_position(func)
        in_place = (
            (name.endswith("_") and not name.endswith("__"))
            or name in _IN_PLACE_DUNDERS
            or kwargs.get("out") is not None
            or kwargs.get("inplace") is True
            or (position is not None and len(args) > position and args[position] is True)
        )
        if not in_place:
            return False
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        return any(_storage(t) in self.protected for t in tensors)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = _func_name(func)
        if _method_name(func) in _READS_VALUES:
            raise _Unkeyable(f"{name} reads tensor values into Python")
        if self._writes_state(func, args, kwargs):
            raise _Unkeyable(f"{name} writes in place to a parameter or buffer")
        call = f"{name}({self.value(list(args))};{self.value(kwargs)})"
        out = func(*args, **kwargs)
        index = len(self.lines)
        results = []
        for j, leaf in enumerate(pytree.tree_leaves(out)):
            if isinstance(leaf, torch.Tensor):
                # In-place calls return their argument: its name moves to this result.
                self.refs[id(leaf)] = f"%{index}.{j}"
                self.alive.append(leaf)
                results.append(self._meta(leaf))
            else:
                results.append(self.value(leaf))
        self.lines.append(f"{call} -> {','.join(results)}")
        return out


@functools.lru_cache(maxsize=1)
def _ember_sources() -> str:
    """Ember's own identity: version, the Rust build, and the export settings' source."""
    here = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.blake2b(digest_size=16)
    for name in ("export.py", "trace_key.py"):
        with open(os.path.join(here, name), "rb") as f:
            digest.update(f.read())
    return f"{_core.__version__} {_core.BUILD_ID} {digest.hexdigest()}"


def _code_identity(model: torch.nn.Module) -> list[str]:
    """The model's classes, with their source files' size and modification time and their
    packages' versions: code that runs differently under export than in eager (a branch on
    `torch.compiler.is_compiling()`) can only change by changing these files."""
    lines = []
    classes = sorted(
        {type(m) for m in model.modules()}, key=lambda c: c.__module__ + c.__qualname__
    )
    for cls in classes:
        module = sys.modules.get(cls.__module__)
        path = getattr(module, "__file__", None)
        try:
            stat = os.stat(path) if path else None
        except OSError:
            stat = None
        package = sys.modules.get(cls.__module__.partition(".")[0])
        version = getattr(package, "__version__", None)
        lines.append(
            f"class {cls.__module__}.{cls.__qualname__} {path} "
            f"{stat.st_size if stat else None} {stat.st_mtime_ns if stat else None} {version}"
        )
    return lines


@contextlib.contextmanager
def _as_under_export() -> Iterator[None]:
    """torch.export's flags as its non-strict tracing sets them: code that branches on
    ``torch.compiler.is_compiling()`` / ``is_exporting()`` (transformers skips its
    data-dependent mask checks so) takes the branch the export will take."""
    flags = [f for f in ("_is_compiling_flag", "_is_exporting_flag") if hasattr(torch.compiler, f)]
    old = [getattr(torch.compiler, f) for f in flags]
    try:
        for f in flags:
            setattr(torch.compiler, f, True)
        yield
    finally:
        for f, v in zip(flags, old, strict=True):
            setattr(torch.compiler, f, v)


def model_key(model: torch.nn.Module, example_inputs: Sequence[Any], extra: str = "") -> str | None:
    """A key that names what ``torch.export`` makes of ``model(*example_inputs)`` (and of
    ``extra``: other export settings), or None when the model cannot be keyed (see the
    module's docstring). Runs the model once."""
    recorder = _Recorder(model)
    recorder.lines[:0] = [
        _FORMAT,
        extra,
        _ember_sources(),
        f"torch {torch.__version__} default dtype {torch.get_default_dtype()}",
        *_code_identity(model),
    ]
    versions = [t._version for t in recorder.alive]
    args: list[Any] = []
    try:
        for i, a in enumerate(example_inputs):
            args.append(recorder.input_clone(i, a))
        with torch.no_grad(), _as_under_export(), recorder:
            out = model(*args)
        leaves, spec = pytree.tree_flatten(out)
        recorder.lines.append(f"return {spec} {recorder.value(leaves)}")
    except _Unkeyable as e:
        _log.debug("ember: no export-cache key for %s: %s", type(model).__name__, e)
        return None
    except Exception as e:  # noqa: BLE001 - the export reports the model's own errors
        _log.debug("ember: no export-cache key, the eager run failed: %s", e)
        return None
    if [t._version for t in recorder.alive[: len(versions)]] != versions:
        # Not reached unless a write slipped past `_writes_state`; such a run is not keyed.
        _log.warning("ember: the model changed its weights while it was run for a cache key")
        return None
    text = "\n".join(recorder.lines)
    return hashlib.blake2b(text.encode(), digest_size=20).hexdigest()
