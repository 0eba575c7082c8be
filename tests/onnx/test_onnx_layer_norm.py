"""Layer norm as exporters wrote it before opset 17 (`ReduceMean → Sub → Pow → ReduceMean →
Add → Sqrt → Div → Mul → Add`) runs as one fused LayerNorm, with the results of the
decomposed graph (checked against ONNX Runtime and eager)."""

from __future__ import annotations

import io

import ember
import numpy as np
import onnx
import pytest
import torch
from onnx import helper
from onnx_util import check, make_model, ort_run, randn


def _layer_norm_model(square: str, divide: str, weight: bool, bias: bool, axes=(-1,)):
    x = randn(2, 5, 16, seed=4) * 3 + 1.5
    inits = {
        "two": np.array(2.0, dtype=np.float32),
        "eps": np.array(1e-5, dtype=np.float32),
        "axes": np.array(list(axes), dtype=np.int64),
        "w": randn(*([5, 16][-len(axes) :]), seed=5),
        "b": randn(*([5, 16][-len(axes) :]), seed=6),
    }
    nodes = [
        helper.make_node("ReduceMean", ["x", "axes"], ["mean"], keepdims=1),
        helper.make_node("Sub", ["x", "mean"], ["d"]),
        helper.make_node("Pow", ["d", "two"], ["sq"])
        if square == "pow"
        else helper.make_node("Mul", ["d", "d"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["var"], keepdims=1),
        helper.make_node("Add", ["var", "eps"], ["var_eps"]),
        helper.make_node("Sqrt", ["var_eps"], ["std"]),
    ]
    if divide == "div":
        nodes.append(helper.make_node("Div", ["d", "std"], ["normed"]))
    else:  # times the reciprocal
        nodes += [
            helper.make_node("Reciprocal", ["std"], ["inv"]),
            helper.make_node("Mul", ["inv", "d"], ["normed"]),
        ]
    out = "normed"
    if weight:
        nodes.append(helper.make_node("Mul", [out, "w"], ["scaled"]))
        out = "scaled"
    if bias:
        nodes.append(helper.make_node("Add", ["b", out], ["shifted"]))
        out = "shifted"
    return make_model(nodes, {"x": x}, [out], initializers=inits), {"x": x}


@pytest.mark.parametrize("square,divide", [("pow", "div"), ("mul", "recip")])
@pytest.mark.parametrize("weight", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_decomposed_layer_norm_runs_fused(square, divide, weight, bias) -> None:
    model, feeds = _layer_norm_model(square, divide, weight, bias)
    compiled = ember.compile_onnx(model)
    check(model, feeds, rtol=1e-5, atol=1e-5, compiled=compiled)
    ir = compiled.ir()
    assert "layer_norm(" in ir and "sqrt(" not in ir and "rms_norm(" not in ir, ir
    operands = 1 + weight + bias
    call = ir[ir.index("layer_norm(") :].split(")")[0]
    assert call.count("%") == operands, ir


def test_layer_norm_over_two_dims_runs_fused() -> None:
    model, feeds = _layer_norm_model("pow", "div", True, True, axes=(-2, -1))
    compiled = ember.compile_onnx(model)
    check(model, feeds, rtol=1e-5, atol=1e-5, compiled=compiled)
    assert "layer_norm(" in compiled.ir()


def test_mean_and_variance_over_different_dims_stay_decomposed() -> None:
    """The mean over the last dim, the variance over the last two: not a layer norm."""
    model, feeds = _layer_norm_model("pow", "div", False, False)
    axes2 = onnx.numpy_helper.from_array(np.array([-2, -1], dtype=np.int64), "axes2")
    model.graph.initializer.append(axes2)
    for node in model.graph.node:
        if node.output[0] == "var":
            node.input[1] = "axes2"
    compiled = ember.compile_onnx(model)
    check(model, feeds, rtol=1e-5, atol=1e-5, compiled=compiled)
    assert "layer_norm(" not in compiled.ir()


def test_a_centered_value_read_elsewhere_still_computes_both() -> None:
    """x - mean(x) is also an output: the norm may fuse, but the difference must stay."""
    model, feeds = _layer_norm_model("pow", "div", True, True)
    model.graph.output.append(helper.make_tensor_value_info("d", onnx.TensorProto.FLOAT, None))
    compiled = ember.compile_onnx(model)
    got = compiled(**feeds)
    want = ort_run(model, feeds)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5)


def test_legacy_exported_feed_forward_block_runs_fused_layer_norms() -> None:
    """A BERT-style feed-forward block exported by torch's TorchScript exporter at opset 14,
    as many model-hub files were: its two LayerNorms arrive written out."""
    torch.manual_seed(0)
    layer = torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.LayerNorm(64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 32),
        torch.nn.LayerNorm(32, eps=1e-12),
    ).eval()
    x = torch.randn(2, 7, 32)
    buf = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(layer, (x,), buf, opset_version=14, dynamo=False)
    model = onnx.load_from_string(buf.getvalue())
    assert "LayerNormalization" not in {n.op_type for n in model.graph.node}
    name = model.graph.input[0].name
    compiled = ember.compile_onnx(model)
    check(model, {name: x.numpy()}, rtol=1e-4, atol=1e-4, compiled=compiled)
    assert compiled.ir().count("layer_norm(") == 2, compiled.ir()
    with torch.no_grad():
        np.testing.assert_allclose(
            np.asarray(compiled(x.numpy())[0]), layer(x).numpy(), rtol=1e-4, atol=1e-4
        )
