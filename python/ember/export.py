"""From a torch model to a ``.pt2`` archive: ``torch.export`` to core ATen, keeping the
composite ops Ember runs fused (softmax, layer/rms norm, attention, linear, gelu, silu)."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Sequence
from typing import Any

import torch
from torch.export import Dim, ExportedProgram

_aten = torch.ops.aten

# Ops the IR has as composites (or lowers better than torch's decomposition does).
_KEEP = [
    "softmax.int",
    "_softmax.default",
    "log_softmax.int",
    "_log_softmax.default",
    "layer_norm.default",
    "rms_norm.default",
    "scaled_dot_product_attention.default",
    "linear.default",
    "gelu.default",
    "silu.default",
    "matmul.default",
    # Resizes: Ember gathers with constant indices; torch's decompositions index with
    # several broadcast index tensors at once. Kept whole, any mode the frontend lacks
    # would be named in the error instead of an indexing op.
    "upsample_nearest1d.vec",
    "upsample_nearest2d.vec",
    "upsample_nearest3d.vec",
    "_upsample_nearest_exact1d.vec",
    "_upsample_nearest_exact2d.vec",
    "_upsample_nearest_exact3d.vec",
    "upsample_bilinear2d.vec",
    "upsample_bicubic2d.vec",
    "upsample_linear1d.vec",
    "upsample_trilinear3d.vec",
]


def _decomposition_table() -> dict[Any, Any]:
    table = torch.export.default_decompositions()
    for name in _KEEP:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(_aten, packet, None), overload, None)
        if op is not None and op in table:
            del table[op]
    return table


def _strip_grad_mode_calls(gm: torch.fx.GraphModule) -> None:
    """Dynamo records ``torch.no_grad()`` blocks as ``_set_grad_enabled`` calls; inference
    needs no autograd, and torch.export would wrap them in a higher-order op."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            gm.graph.erase_node(node)
            changed = True
    if changed:
        gm.recompile()


def prepare_graph_module(model: torch.nn.Module) -> None:
    """Readies a Dynamo graph module for export (and for a run that keys it: the same code)."""
    if isinstance(model, torch.fx.GraphModule):
        _strip_grad_mode_calls(model)
        # Dynamo's lazy graph modules have a `forward(*args)` stub until first compiled;
        # export reads the real signature to match `dynamic_shapes` with the arguments.
        real_recompile = getattr(model, "real_recompile", None)
        if real_recompile is not None:
            real_recompile()


def export_onnx_bytes(
    model: torch.nn.Module, args: Sequence[Any], dynamic_shapes: Any = None
) -> bytes:
    """Exports ``model(*args)`` with ``torch.onnx.export`` (opset 18, weights included) and
    serializes the ONNX model for ``ember.compile_onnx``."""
    prepare_graph_module(model)
    with torch.no_grad():
        program = torch.onnx.export(
            model, tuple(args), dynamic_shapes=dynamic_shapes, opset_version=18, verbose=False
        )
    return program.model_proto.SerializeToString()


def export_program(
    model: torch.nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    dynamic_shapes: Any = None,
) -> ExportedProgram:
    """Exports ``model(*args, **kwargs)`` to core ATen with Ember's composites kept."""
    prepare_graph_module(model)
    with torch.no_grad():
        ep = torch.export.export(
            model, tuple(args), kwargs or {}, dynamic_shapes=dynamic_shapes, strict=False
        )
        return ep.run_decompositions(_decomposition_table())


def dynamo_dynamic_shapes(
    gm: torch.fx.GraphModule, args: Sequence[Any], tied: bool = True
) -> tuple[Any, ...] | None:
    """``dynamic_shapes`` for exporting a Dynamo graph: the dims Dynamo made symbolic (after
    a size changed, or by ``mark_dynamic`` / ``dynamic=True``) stay symbolic, so one compiled
    program serves every size. ``None`` when the graph is fully static.

    ``tied``: dims Dynamo gave one symbol (a decode step's key and value caches, both ``s0``
    long) are one export ``Dim``, within the range Dynamo's guards leave it. Export then
    keeps them one symbol (each its own ``Dim.AUTO`` lets export specialize one of them when
    it cannot prove them equal: a recompile for every cache length) and knows the range
    (so a rotary table sliced at the cache length is one row long, not a clamp).
    Untied: each dim is its own ``Dim.AUTO``, for graphs whose export rejects the ties."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(args):
        return None
    shared: dict[str, Any] = {}

    def dim_of(size: Any) -> Any:
        expr = getattr(getattr(size, "node", None), "expr", None)
        if not tied or expr is None or not getattr(expr, "is_Symbol", False):
            return Dim.AUTO
        name = str(expr)
        if name not in shared:
            ranges = getattr(size.node.shape_env, "var_to_range", {}).get(expr)
            lo = _finite(getattr(ranges, "lower", None))
            hi = _finite(getattr(ranges, "upper", None))
            if lo is not None and hi is not None and hi <= lo:
                return Dim.AUTO
            shared[name] = Dim(f"dyn_{name}", min=lo, max=hi)
        return shared[name]

    spec: list[Any] = []
    for node, arg in zip(placeholders, args, strict=True):
        example = node.meta.get("example_value")
        if isinstance(arg, torch.Tensor) and isinstance(example, torch.Tensor):
            dims = {i: dim_of(s) for i, s in enumerate(example.shape) if _symbolic(s)}
            spec.append(dims or None)
        elif isinstance(example, torch.SymInt):
            spec.append(Dim.AUTO)
        else:
            spec.append(None)
    return tuple(spec) if any(s is not None for s in spec) else None


def _symbolic(size: Any) -> bool:
    """Whether a size of a Dynamo example is symbolic (a ``SymInt`` whose guards have
    not pinned it to a number)."""
    if isinstance(size, int):
        return False
    expr = getattr(getattr(size, "node", None), "expr", None)
    return not getattr(expr, "is_number", False)


def _finite(bound: Any) -> int | None:
    """A value range's bound as an int; ``None`` for an infinite one (torch's ``int_oo``)."""
    if bound is None:
        return None
    try:
        value = int(bound)
    except Exception:  # noqa: BLE001 - sympy infinities refuse int() in several ways
        return None
    return value if abs(value) < (1 << 62) else None


def save_bytes(ep: ExportedProgram) -> bytes:
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    return buf.getvalue()


def program_archive(ep: ExportedProgram) -> bytes:
    """A ``.pt2`` archive holding only the exported program's JSON: all that
    ``_core.load_pt2(..., load_weights=False)`` reads, since weights are bound by pointer.
    ``torch.export.save`` would also write every weight (5 s for a 256 MB EfficientNet)."""
    try:
        from torch._export.serde.serialize import serialize

        program = serialize(
            ep,
            serialize_state_dict=False,
            serialize_constants=False,
            serialize_example_inputs=False,
        ).exported_program
    except (ImportError, TypeError, AttributeError):  # another torch's private API
        return save_bytes(ep)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/models/model.json", program)
    return buf.getvalue()


def live_weights(ep: ExportedProgram) -> dict[str, torch.Tensor]:
    """Parameters, buffers and lifted constants by their fully qualified names: the tensors
    the compiled program binds by pointer."""
    weights: dict[str, torch.Tensor] = {}
    for name, t in ep.state_dict.items():
        weights[name] = t
    for name, t in ep.constants.items():
        if isinstance(t, torch.Tensor):
            weights[name] = t
    return weights
