"""Opsets 22–25: the transformer ops of opset 23 (Attention, RMSNormalization,
RotaryEmbedding), Swish (24), the opset-23 attributes of QuantizeLinear/DequantizeLinear, and
models torch's exporter writes at opset 23 and 24, each against ONNX Runtime."""

from __future__ import annotations

from typing import Any

import ember
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from onnx_util import (
    BACKEND_NAMES,
    BACKENDS,
    check,
    compile_on,
    make_model,
    randn,
    with_backend,
)

ATTN = {"rtol": 1e-5, "atol": 1e-5}


def _model(
    op: str,
    inputs: dict[str, np.ndarray | None],
    attrs: dict[str, Any] | None = None,
    outputs: tuple[str, ...] = ("y",),
    opset: int = 23,
    initializers: dict[str, np.ndarray] | None = None,
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One `op` node; a `None` input is an omitted optional input."""
    names = [("" if a is None else n) for n, a in inputs.items()]
    inits = initializers or {}
    feeds = {n: a for n, a in inputs.items() if a is not None and n not in inits}
    node = helper.make_node(op, names, list(outputs), name=f"{op.lower()}_node", **(attrs or {}))
    model = make_model([node], feeds, [o for o in outputs if o], inits, opset)
    model.ir_version = 10
    return model, feeds


# RMSNormalization -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("axis", "scale_shape"), [(-1, (16,)), (-2, (5, 16)), (1, (16,)), (2, (1,))]
)
def test_rms_normalization(axis: int, scale_shape: tuple[int, ...]) -> None:
    x = randn(2, 5, 16, seed=1) * 3
    scale = randn(*scale_shape, seed=2)
    model, feeds = _model(
        "RMSNormalization", {"x": x, "scale": scale}, {"axis": axis, "epsilon": 1e-4}
    )
    compiled = ember.compile_onnx(model)
    check(model, feeds, rtol=1e-5, atol=1e-5, compiled=compiled)
    assert "rms_norm(" in compiled.ir()


# Swish ----------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [1.0, 0.7])
def test_swish(alpha: float) -> None:
    x = randn(4, 33, seed=3) * 4
    model, feeds = _model("Swish", {"x": x}, {"alpha": alpha}, opset=24)
    check(model, feeds, rtol=1e-5, atol=1e-6)


# RotaryEmbedding ------------------------------------------------------------------------


def _caches(positions: int, half: int) -> tuple[np.ndarray, np.ndarray]:
    angles = randn(positions, half, seed=7) * 3
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize(("layout", "rotary_dim"), [("4d", 0), ("3d", 0), ("4d", 8), ("3d", 4)])
def test_rotary_embedding_with_position_ids(
    layout: str, rotary_dim: int, interleaved: int, backend: str
) -> None:
    b, h, s, d = 2, 3, 5, 16
    x4 = randn(b, h, s, d, seed=4)
    half = (rotary_dim or d) // 2
    cos, sin = _caches(32, half)
    ids = np.random.default_rng(5).integers(0, 32, size=(b, s)).astype(np.int64)
    attrs: dict[str, Any] = {"interleaved": interleaved, "rotary_embedding_dim": rotary_dim}
    x = x4
    if layout == "3d":
        x = np.ascontiguousarray(x4.transpose(0, 2, 1, 3).reshape(b, s, h * d))
        attrs["num_heads"] = h
    model, feeds = _model(
        "RotaryEmbedding",
        {"x": x, "cos": cos, "sin": sin, "ids": ids},
        attrs,
        initializers={"cos": cos, "sin": sin},
    )
    compiled = compile_on(model, backend)
    check(model, feeds, rtol=1e-5, atol=1e-5, compiled=compiled)


def test_rotary_embedding_with_per_token_caches() -> None:
    b, h, s, d = 2, 2, 6, 8
    x = randn(b, h, s, d, seed=6)
    angles = randn(b, s, d // 2, seed=8)
    cos, sin = np.cos(angles), np.sin(angles)
    model, feeds = _model("RotaryEmbedding", {"x": x, "cos": cos, "sin": sin})
    check(model, feeds, rtol=1e-5, atol=1e-5)


def test_rotary_embedding_rejects_a_cache_of_the_wrong_width() -> None:
    x = randn(1, 2, 4, 16, seed=6)
    cos, sin = _caches(8, 4)
    ids = np.zeros((1, 4), dtype=np.int64)
    model, _ = _model(
        "RotaryEmbedding",
        {"x": x, "cos": cos, "sin": sin, "ids": ids},
        initializers={"cos": cos, "sin": sin},
    )
    with pytest.raises(ember.CompileError, match="angles per position"):
        ember.compile_onnx(model)


# Attention ------------------------------------------------------------------------------


def _heads(b: int, h: int, s: int, d: int, seed: int) -> np.ndarray:
    return randn(b, h, s, d, seed=seed)


def _to3d(x: np.ndarray) -> np.ndarray:
    b, h, s, d = x.shape
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(b, s, h * d))


ATTENTION_CASES: dict[str, dict[str, Any]] = {
    "mha": {},
    "causal": {"causal": 1},
    "gqa causal": {"causal": 1, "kv_heads": 2},
    "mqa": {"kv_heads": 1},
    "cross": {"kv_len": 9},
    "cross causal": {"kv_len": 9, "causal": 1},
    "scale": {"scale": 0.3},
    "value width": {"dv": 12},
    "bool mask 2d": {"mask": "bool2d"},
    "bool mask 4d": {"mask": "bool4d", "causal": 1},
    "float mask": {"mask": "float"},
    # ONNX Runtime refuses masks shorter than the keys: onnx's reference implementation
    # checks these.
    "short float mask": {"mask": "short float", "reference": "onnx"},
    "short bool mask": {"mask": "short bool", "reference": "onnx"},
    "softcap": {"softcap": 2.0},
    "softcap causal mask": {"softcap": 3.0, "causal": 1, "mask": "bool2d"},
    # A query row that sees no key gives zeros (not NaN), fused or soft-capped.
    "hidden row": {"mask": "hidden row"},
    "softcap hidden row": {"mask": "hidden row", "softcap": 2.0},
}
# The cases the emulator also runs: those that take different paths.
EMULATED = ["gqa causal", "bool mask 4d", "float mask", "softcap causal mask", "hidden row"]


def _mask(kind: str, b: int, h: int, q: int, t: int) -> np.ndarray:
    gen = np.random.default_rng(11)
    if kind == "bool2d":
        keep = gen.random((q, t)) > 0.3
        keep[:, 0] = True
        return keep
    if kind == "bool4d":
        keep = gen.random((b, h, q, t)) > 0.3
        keep[..., 0] = True
        return keep
    if kind == "float":
        return (gen.standard_normal((b, 1, q, t)) * 2).astype(np.float32)
    if kind == "short float":
        return (gen.standard_normal((q, t - 3)) * 2).astype(np.float32)
    if kind == "hidden row":
        keep = gen.random((q, t)) > 0.3
        keep[:, 0] = True
        keep[2] = False
        return keep
    if kind == "short bool":
        keep = gen.random((b, 1, q, t - 2)) > 0.3
        keep[..., 0] = True
        return keep
    raise ValueError(kind)


@pytest.mark.parametrize(
    ("case", "backend"),
    [(c, "cpu") for c in ATTENTION_CASES]
    + [with_backend((c,), b) for c in EMULATED for b in BACKEND_NAMES[1:]],
)
@pytest.mark.parametrize("layout", ["4d", "3d"])
def test_attention(case: str, layout: str, backend: str) -> None:
    c = ATTENTION_CASES[case]
    b, hq, q_len, d = 2, 4, 7, 8
    hkv, kv_len, dv = c.get("kv_heads", hq), c.get("kv_len", q_len), c.get("dv", d)
    q = _heads(b, hq, q_len, d, 1)
    k = _heads(b, hkv, kv_len, d, 2)
    v = _heads(b, hkv, kv_len, dv, 3)
    attrs: dict[str, Any] = {"is_causal": c.get("causal", 0)}
    for name in ("scale", "softcap"):
        if name in c:
            attrs[name] = c[name]
    if layout == "3d":
        q, k, v = _to3d(q), _to3d(k), _to3d(v)
        attrs |= {"q_num_heads": hq, "kv_num_heads": hkv}
    inputs: dict[str, np.ndarray | None] = {"q": q, "k": k, "v": v}
    if "mask" in c:
        inputs["mask"] = _mask(c["mask"], b, hq, q_len, kv_len)
    model, feeds = _model("Attention", inputs, attrs)
    compiled = compile_on(model, backend)
    if c.get("reference") != "onnx":
        check(model, feeds, compiled=compiled, **ATTN)
        return
    (want,) = ReferenceEvaluator(model).run(None, feeds)
    (got,) = compiled(**feeds)
    np.testing.assert_allclose(got, want, **ATTN)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("new", [1, 3])
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("layout", ["4d", "3d"])
def test_attention_with_a_kv_cache(new: int, causal: int, layout: str, backend: str) -> None:
    """past_key/past_value concatenated inside; present_key/present_value returned; the
    causal frontier bottom-right aligned behind the cache."""
    b, hq, hkv, past, d = 1, 4, 2, 5, 8
    q = _heads(b, hq, new, d, 1)
    k = _heads(b, hkv, new, d, 2)
    v = _heads(b, hkv, new, d, 3)
    attrs: dict[str, Any] = {"is_causal": causal}
    if layout == "3d":
        q, k, v = _to3d(q), _to3d(k), _to3d(v)
        attrs |= {"q_num_heads": hq, "kv_num_heads": hkv}
    inputs: dict[str, np.ndarray | None] = {
        "q": q,
        "k": k,
        "v": v,
        "": None,
        "past_k": _heads(b, hkv, past, d, 4),
        "past_v": _heads(b, hkv, past, d, 5),
    }
    model, feeds = _model("Attention", inputs, attrs, outputs=("y", "present_k", "present_v"))
    check(model, feeds, compiled=compile_on(model, backend), **ATTN)


def test_attention_with_a_symbolic_cache_length() -> None:
    """One compiled model for every cache length (the causal offset is a dim expression)."""
    b, h, new, d = 1, 2, 3, 8
    q, k, v = (_heads(b, h, new, d, s) for s in (1, 2, 3))
    past_k, past_v = _heads(b, h, 4, d, 4), _heads(b, h, 4, d, 5)
    node = helper.make_node(
        "Attention", ["q", "k", "v", "", "pk", "pv"], ["y", "ok", "ov"], is_causal=1
    )
    f = TensorProto.FLOAT
    ins = [
        helper.make_tensor_value_info("q", f, [b, h, new, d]),
        helper.make_tensor_value_info("k", f, [b, h, new, d]),
        helper.make_tensor_value_info("v", f, [b, h, new, d]),
        helper.make_tensor_value_info("pk", f, [b, h, "past", d]),
        helper.make_tensor_value_info("pv", f, [b, h, "past", d]),
    ]
    outs = [helper.make_empty_tensor_value_info(n) for n in ("y", "ok", "ov")]
    graph = helper.make_graph([node], "g", ins, outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    compiled = ember.compile_onnx(model)
    for past in (4, 9):
        past_k, past_v = _heads(b, h, past, d, 4), _heads(b, h, past, d, 5)
        feeds = {"q": q, "k": k, "v": v, "pk": past_k, "pv": past_v}
        check(model, feeds, compiled=compiled, **ATTN)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [0, 1])
def test_attention_over_a_fixed_size_cache(causal: int, backend: str) -> None:
    """Opset 24's external cache: TensorScatter writes the new keys and values at each
    sequence's length, Attention reads the whole cache up to nonpad_kv_seqlen."""
    b, h, new, size, d = 2, 2, 3, 10, 8
    i64 = TensorProto.INT64
    nodes = [
        helper.make_node("TensorScatter", ["past_k", "k", "at"], ["cache_k"]),
        helper.make_node("TensorScatter", ["past_v", "v", "at"], ["cache_v"]),
        helper.make_node("Add", ["at", "new"], ["lens"]),
        helper.make_node(
            "Attention",
            ["q", "cache_k", "cache_v", "", "", "", "lens"],
            ["y"],
            is_causal=causal,
        ),
    ]
    feeds = {
        "q": _heads(b, h, new, d, 1),
        "k": _heads(b, h, new, d, 2),
        "v": _heads(b, h, new, d, 3),
        "past_k": _heads(b, h, size, d, 4),
        "past_v": _heads(b, h, size, d, 5),
        "at": np.array([2, 7], dtype=np.int64),
    }
    inits = {"new": np.array(new, dtype=np.int64)}
    model = make_model(nodes, feeds, ["y", "cache_k", "cache_v"], inits, opset=24)
    model.ir_version = 10
    assert model.graph.input[-1].type.tensor_type.elem_type == i64
    check(model, feeds, compiled=compile_on(model, backend), **ATTN)


def test_nonpad_lengths_shorter_than_the_queries_hide_whole_rows() -> None:
    """A sequence with fewer valid keys than queries: its first causal rows see no key and
    are zeros."""
    q = _heads(2, 2, 3, 8, 1)
    k, v = _heads(2, 2, 6, 8, 2), _heads(2, 2, 6, 8, 3)
    lens = np.array([1, 6], dtype=np.int64)
    model, feeds = _model(
        "Attention",
        {"q": q, "k": k, "v": v, "": None, "pk": None, "pv": None, "lens": lens},
        {"is_causal": 1},
        opset=24,
    )
    (got,) = check(model, feeds, **ATTN)
    assert not got[0, :, :2].any() and got[0, :, 2].any()


@pytest.mark.parametrize("mode", ["linear", "circular"])
def test_tensor_scatter(mode: str) -> None:
    past, update = randn(2, 9, 3, 4, seed=1), randn(2, 4, 3, 4, seed=2)
    at = np.array([0, 5 if mode == "linear" else 7], dtype=np.int64)
    model, feeds = _model(
        "TensorScatter",
        {"past": past, "update": update, "at": at},
        {"axis": 1, "mode": mode},
        opset=24,
    )
    check(model, feeds)


def test_attention_refuses_what_it_does_not_compute() -> None:
    q = _heads(1, 2, 3, 8, 1)
    model, _ = _model("Attention", {"q": q, "k": q, "v": q}, outputs=("y", "", "", "qk"))
    with pytest.raises(ember.UnsupportedOpError, match="qk_matmul_output"):
        ember.compile_onnx(model)
    model, _ = _model("Attention", {"q": _to3d(q), "k": _to3d(q), "v": _to3d(q)})
    with pytest.raises(ember.CompileError, match="q_num_heads"):
        ember.compile_onnx(model)


# QuantizeLinear / DequantizeLinear at opset 23 -------------------------------------------


def test_quantize_precision_and_dequantize_output_dtype() -> None:
    x = randn(4, 16, seed=9) * 3
    scale = np.array(0.05, dtype=np.float32)
    zero = np.array(3, dtype=np.uint8)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], precision=TensorProto.FLOAT),
        helper.make_node(
            "DequantizeLinear", ["q", "s", "z"], ["y"], output_dtype=TensorProto.FLOAT16
        ),
    ]
    model = make_model(nodes, {"x": x}, ["y", "q"], {"s": scale, "z": zero}, opset=23)
    model.ir_version = 10
    check(model, {"x": x}, rtol=1e-3, atol=1e-3)


# Whole models from torch's exporter ----------------------------------------------------------


class _Block(torch.nn.Module):
    """RMS norm, grouped-query causal attention, SiLU MLP: what the exporter writes as
    RMSNormalization and Attention at opset 23."""

    def __init__(self, dim: int = 64, heads: int = 8, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm = torch.nn.RMSNorm(dim, eps=1e-5)
        self.q = torch.nn.Linear(dim, dim, bias=False)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.o = torch.nn.Linear(dim, dim, bias=False)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm(x)
        q = self.q(h).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


@pytest.mark.parametrize("opset", [23, 24])
def test_torch_export_at_new_opsets(tmp_path, opset: int) -> None:
    torch.manual_seed(0)
    model = _Block().eval()
    x = torch.randn(2, 10, 64)
    path = tmp_path / "block.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=True, opset_version=opset, input_names=["x"])
    written = onnx.load(str(path))
    ops = {n.op_type for n in written.graph.node}
    assert {"Attention", "RMSNormalization"} <= ops, ops
    compiled = ember.compile_onnx(str(path))
    got = check(written, {"x": x.numpy()}, rtol=1e-4, atol=1e-4, compiled=compiled)
    with torch.no_grad():
        np.testing.assert_allclose(got[0], model(x).numpy(), rtol=1e-4, atol=1e-4)
    assert "attention(" in compiled.ir() and "rms_norm(" in compiled.ir()


def test_opsets_past_the_supported_range_are_refused() -> None:
    x = randn(3, seed=1)
    model, _ = _model("Relu", {"x": x}, opset=26)
    with pytest.raises(ember.CompileError, match="opsets 13 to 25"):
        ember.compile_onnx(model)


def test_half_precision_attention_and_rms_norm() -> None:
    """float16 operands: as ONNX Runtime computes them, within half-precision rounding."""
    q = _heads(1, 4, 6, 16, 1).astype(np.float16)
    k = _heads(1, 2, 6, 16, 2).astype(np.float16)
    v = _heads(1, 2, 6, 16, 3).astype(np.float16)
    attrs = {"is_causal": 1, "softmax_precision": TensorProto.FLOAT}
    model, feeds = _model("Attention", {"q": q, "k": k, "v": v}, attrs)
    check(model, feeds, rtol=2e-3, atol=2e-3)
    x, scale = randn(2, 5, 16, seed=1).astype(np.float16), randn(16, seed=2).astype(np.float16)
    model, feeds = _model("RMSNormalization", {"x": x, "scale": scale})
    check(model, feeds, rtol=2e-3, atol=2e-3)


def test_hugging_face_llama_at_opset_23_two_lengths(tmp_path) -> None:
    """transformers' Llama (random weights, SDPA attention with its padding mask) exported
    at opset 23 with a dynamic sequence: Attention, RMSNormalization, RotaryEmbedding, one
    compiled model for both lengths."""
    hf_models = pytest.importorskip("ember.hf_models")
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = hf_models.MainOutput(hf_models.build("llama")).eval()
    ids, mask = hf_models.forward_inputs(2, 12)
    path = tmp_path / "llama.onnx"
    seq = torch.export.Dim("seq", min=2, max=64)
    torch.onnx.export(
        model,
        (ids, mask),
        str(path),
        dynamo=True,
        opset_version=23,
        input_names=["input_ids", "attention_mask"],
        dynamic_shapes=({1: seq}, {1: seq}),
    )
    written = onnx.load(str(path))
    ops = {n.op_type for n in written.graph.node}
    assert {"Attention", "RMSNormalization", "RotaryEmbedding"} <= ops, ops
    compiled = ember.compile_onnx(str(path))
    # Checked against eager: ONNX Runtime 1.32 refuses this file's RotaryEmbedding, whose
    # per-token caches have batch 1 (Hugging Face's position ids) for a batch of 2, where
    # the spec broadcasts them.
    for length in (12, 7):
        ids, mask = hf_models.forward_inputs(2, length)
        (got,) = compiled(input_ids=ids.numpy(), attention_mask=mask.numpy())
        with torch.no_grad():
            np.testing.assert_allclose(got, model(ids, mask).numpy(), rtol=1e-4, atol=1e-4)
