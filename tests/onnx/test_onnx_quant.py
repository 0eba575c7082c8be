"""Quantization ops against ONNX Runtime: QuantizeLinear / DequantizeLinear (per tensor and
per axis, int8 and uint8, with and without zero points), DynamicQuantizeLinear and
MatMulInteger, and whole models quantized by onnxruntime.quantization (dynamic: MatMulInteger;
static: QDQ, per tensor and per channel), whose products must run on the integer kernels.
Integer outputs must match exactly."""

from __future__ import annotations

import io

import ember
import numpy as np
import onnx
import pytest
import torch
from onnx_util import calibration, check, int8_weights, make_model, randn, rng, single


@pytest.mark.usefixtures("check_backend")
@pytest.mark.parametrize("qtype", [np.uint8, np.int8])
@pytest.mark.parametrize("per_axis", [False, True])
def test_quantize_then_dequantize(qtype, per_axis) -> None:
    x = randn(2, 3, 5, seed=1) * 4
    # Values on rounding ties (x / scale = k + 0.5) round half to even, as ORT does.
    x[0, 0, :4] = np.array([0.25, 0.75, -0.25, -1.25], dtype=np.float32)
    if per_axis:
        scale = np.array([0.5, 0.03, 0.1], dtype=np.float32)
        zero = (
            np.array([3, 0, 120], dtype=qtype)
            if qtype == np.uint8
            else np.array([3, 0, -7], dtype=qtype)
        )
    else:
        scale, zero = np.array(0.5, dtype=np.float32), np.array(7, dtype=qtype)
    nodes = [
        onnx.helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], axis=1),
        onnx.helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"], axis=1),
    ]
    model = make_model(nodes, {"x": x}, ["q", "d"], initializers={"s": scale, "z": zero})
    q, _ = check(model, {"x": x})
    # Saturation happened: the per-axis scale 0.03 puts values beyond the 8-bit range.
    if per_axis:
        info = np.iinfo(qtype)
        assert (q == info.max).any() or (q == info.min).any()


@pytest.mark.usefixtures("check_backend")
def test_quantize_without_zero_point_is_uint8() -> None:
    x = np.abs(randn(4, 6, seed=2)) * 3
    model = single("QuantizeLinear", {"x": x}, initializers={"s": np.array(0.02, np.float32)})
    (q,) = check(model, {"x": x})
    assert q.dtype == np.uint8


@pytest.mark.usefixtures("check_backend")
def test_dequantize_int32_bias() -> None:
    x = rng(3).integers(-(2**20), 2**20, size=(8,), dtype=np.int32)
    model = single("DequantizeLinear", {"x": x}, initializers={"s": np.array(0.001, np.float32)})
    check(model, {"x": x})


@pytest.mark.usefixtures("check_backend")
def test_dynamic_quantize_linear() -> None:
    for seed, shift in [(4, 0.0), (5, 3.0), (6, -3.0)]:
        x = randn(3, 7, seed=seed) + shift  # mixed signs, all positive, all negative
        model = single("DynamicQuantizeLinear", {"x": x}, outputs=3)
        check(model, {"x": x}, rtol=0, atol=0)


@pytest.mark.usefixtures("check_backend")
@pytest.mark.parametrize("zero_points", ["none", "scalar", "per_column"])
def test_matmul_integer(zero_points) -> None:
    g = rng(7)
    a = g.integers(0, 256, size=(2, 5, 300), dtype=np.uint8)
    b = int8_weights(g, 300, 9)
    inits: dict[str, np.ndarray] = {"b": b}
    names = ["a", "b"]
    if zero_points != "none":
        bz = np.array(-3, np.int8)
        if zero_points == "per_column":
            bz = g.integers(-128, 128, size=(9,), dtype=np.int8)
        inits |= {"az": np.array(128, np.uint8), "bz": bz}
        names += ["az", "bz"]
    model = single("MatMulInteger", {"a": a}, initializers=inits, input_names=names)
    (y,) = check(model, {"a": a})
    assert y.dtype == np.int32


def test_matmul_integer_per_row_zero_point_of_a() -> None:
    # The spec allows A's zero point per row; ORT's CPU kernel takes only a scalar, so this
    # one is checked against numpy's int64 product.
    g = rng(9)
    a = g.integers(-128, 128, size=(5, 40), dtype=np.int8)
    b = g.integers(0, 256, size=(40, 6), dtype=np.uint8)
    az = g.integers(-128, 128, size=(5,), dtype=np.int8)
    model = single(
        "MatMulInteger", {"a": a}, initializers={"b": b, "az": az}, input_names=["a", "b", "az"]
    )
    (y,) = ember.compile_onnx(model)(a=a)
    want = (a.astype(np.int64) - az.astype(np.int64)[:, None]) @ b.astype(np.int64)
    np.testing.assert_array_equal(y, want.astype(np.int32))


def test_blocked_quantization_is_refused_clearly() -> None:
    x = randn(4, 8, seed=8)
    model = single(
        "QuantizeLinear",
        {"x": x},
        {"axis": 1, "block_size": 4},
        initializers={"s": np.full((4, 2), 0.1, np.float32)},
        opset=21,
    )
    with pytest.raises(ember.UnsupportedOpError, match="QuantizeLinear.*block"):
        ember.compile_onnx(model)


def _mlp_onnx() -> tuple[onnx.ModelProto, np.ndarray]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 16)
    ).eval()
    x = torch.randn(8, 64)
    buf = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(model, (x,), buf, opset_version=17, dynamo=False, input_names=["x"])
    return onnx.load_from_string(buf.getvalue()), x.numpy()


def _runs_integer_products(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> bool:
    runner = ember.compile_onnx(model)
    with ember.profile_cpu() as prof:
        runner(**feeds)
    return "integer_dot" in prof.by_label()


@pytest.mark.usefixtures("check_backend")
@pytest.mark.parametrize("weights", ["QUInt8", "QInt8"])
def test_dynamically_quantized_model(tmp_path, weights) -> None:
    quantization = pytest.importorskip("onnxruntime.quantization")
    proto, x = _mlp_onnx()
    src, dst = tmp_path / "mlp.onnx", tmp_path / "mlp.int8.onnx"
    onnx.save(proto, src)
    weight_type = getattr(quantization.QuantType, weights)
    # 7-bit weights (`reduce_range`): ONNX Runtime's own products are exact on every CPU.
    quantization.quantize_dynamic(str(src), str(dst), weight_type=weight_type, reduce_range=True)
    quantized = onnx.load(str(dst))
    ops = {n.op_type for n in quantized.graph.node}
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= ops, ops
    check(quantized, {"x": x}, rtol=1e-5, atol=1e-5)
    assert _runs_integer_products(quantized, {"x": x})


@pytest.mark.usefixtures("check_backend")
@pytest.mark.parametrize("per_channel", [False, True])
def test_statically_quantized_qdq_model(tmp_path, per_channel) -> None:
    quantization = pytest.importorskip("onnxruntime.quantization")
    proto, x = _mlp_onnx()
    src, dst = tmp_path / "mlp.onnx", tmp_path / "mlp.qdq.onnx"
    onnx.save(proto, src)

    quantization.quantize_static(
        str(src),
        str(dst),
        calibration([{"x": randn(8, 64, seed=s)} for s in range(4)]),
        quant_format=quantization.QuantFormat.QDQ,
        per_channel=per_channel,
    )
    quantized = onnx.load(str(dst))
    ops = {n.op_type for n in quantized.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops, ops
    # The product of dequantized values runs on their integers, rounding once where the
    # float product rounds at every step: the output may differ from ORT's by a quantum
    # where a value sits on a rounding boundary of the final quantization.
    check(quantized, {"x": x}, rtol=1e-5, atol=0.05)
    assert _runs_integer_products(quantized, {"x": x})


@pytest.mark.parametrize("k", [256, 257, 4096])
def test_matmul_integer_is_exact_at_the_extremes(k) -> None:
    # Every product 255 · -255, summed over k: the largest sums int8/uint8 products reach
    # (f32 carries them exactly up to k = 256, f64 beyond).
    a = np.full((3, k), 255, dtype=np.uint8)
    a[1] = 0
    b = np.full((k, 4), -128, dtype=np.int8)
    b[:, 1] = 127
    inits = {"b": b, "az": np.array(0, np.uint8), "bz": np.array(127, np.int8)}
    model = single(
        "MatMulInteger", {"a": a}, initializers=inits, input_names=["a", "b", "az", "bz"]
    )
    # Against numpy: ONNX Runtime's own product saturates here on CPUs without VNNI.
    (y,) = ember.compile_onnx(model)(a=a)
    want = a.astype(np.int64) @ (b.astype(np.int64) - 127)
    np.testing.assert_array_equal(y, want.astype(np.int32))
    assert y[0, 0] == -255 * 255 * k
