"""ONNX Runtime's QOperator quantized format against ONNX Runtime: ConvInteger, QLinearConv,
QLinearMatMul, the com.microsoft ops quantize_static writes (QGemm, QLinearAdd, QLinearMul,
QLinearSigmoid, QLinearLeakyRelu, QLinearGlobalAveragePool, QLinearAveragePool,
QLinearConcat), MaxPool on uint8, and a small CNN quantized in both formats.

Integer products must be exact (checked against numpy's int64 arithmetic where ONNX Runtime
has no kernel); requantized outputs may differ from ONNX Runtime's by one quantum where a
value sits on a rounding boundary, and almost never do."""

from __future__ import annotations

import ember
import numpy as np
import onnx
import pytest
import torch
from ember.onnx import load_program
from onnx import helper
from onnx_util import (
    BACKENDS,
    calibration,
    check,
    compile_on,
    int8_weights,
    make_model,
    ort_run,
    randn,
    rng,
    single,
)

MS = "com.microsoft"


def conv_int64(x, w, pads, stride=1, group=1):
    """The exact integer convolution (NCHW, OIHW), in int64."""
    x = np.pad(x.astype(np.int64), [(0, 0), (0, 0), (pads, pads), (pads, pads)])
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    oh, ow = (h - kh) // stride + 1, (wd - kw) // stride + 1
    out = np.zeros((n, o, oh, ow), np.int64)
    og = o // group
    for g in range(group):
        xs = x[:, g * cg : (g + 1) * cg]
        for i in range(kh):
            for j in range(kw):
                patch = xs[:, :, i : i + stride * oh : stride, j : j + stride * ow : stride]
                tap = w[g * og : (g + 1) * og, :, i, j].astype(np.int64)
                out[:, g * og : (g + 1) * og] += np.einsum("nchw,oc->nohw", patch, tap)
    return out


def assert_within_a_quantum(got: np.ndarray, want: np.ndarray) -> None:
    """Quantized outputs: equal but for rare one-quantum steps at rounding boundaries."""
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = np.abs(got.astype(np.int64) - want.astype(np.int64))
    assert diff.max() <= 1, diff.max()
    assert (diff != 0).mean() <= 0.01, (diff != 0).mean()


def ms_model(nodes, inputs, outputs, initializers) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for k, v in inputs.items()
        ],
        [helper.make_empty_tensor_value_info(o) for o in outputs],
        [onnx.numpy_helper.from_array(v, k) for k, v in initializers.items()],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    )
    model.ir_version = 8
    return model


@pytest.mark.parametrize("zero_points", [False, True])
def test_conv_integer_matches_onnx_runtime(zero_points) -> None:
    g = rng(1)
    x = g.integers(0, 256, size=(2, 5, 9, 8), dtype=np.uint8)
    w = g.integers(0, 256, size=(6, 5, 3, 3), dtype=np.uint8)
    inits: dict[str, np.ndarray] = {"w": w}
    names = ["x", "w"]
    if zero_points:
        inits |= {"xz": np.array(130, np.uint8), "wz": np.array(121, np.uint8)}
        names += ["xz", "wz"]
    model = single(
        "ConvInteger",
        {"x": x},
        {"pads": [1, 1, 1, 1]},
        initializers=inits,
        input_names=names,
    )
    (y,) = check(model, {"x": x})
    assert y.dtype == np.int32


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_integer_is_exact_past_float32s_integers(backend) -> None:
    # Sums of 255 · 128 over 64 channels of 3x3 reach 18.8M > 2^24: float32 alone would
    # round them, so the channels are split into exact parts.
    x = np.full((1, 64, 6, 6), 255, np.uint8)
    x[0, :, 0, 0] = 0
    w = np.full((4, 64, 3, 3), -128, np.int8)
    w[1] = 127
    w[2] = rng(2).integers(-128, 128, size=(64, 3, 3), dtype=np.int8)
    wz = np.array([0, 0, 0, -1], np.int8)
    model = single(
        "ConvInteger",
        {"x": x},
        {"pads": [1, 1, 1, 1]},
        initializers={"w": w, "xz": np.array(0, np.uint8), "wz": wz},
        input_names=["x", "w", "xz", "wz"],
    )
    (y,) = compile_on(model, backend)(x=x)
    want = conv_int64(x, w.astype(np.int64) - wz.astype(np.int64)[:, None, None, None], 1)
    assert np.abs(want).max() > 2**24
    np.testing.assert_array_equal(y, want.astype(np.int32))


def qlinear_conv_model(x, w, per_channel: bool, group: int = 1, stride: int = 1):
    g = rng(3)
    o = w.shape[0]
    w_scale = (
        g.uniform(0.004, 0.04, size=o).astype(np.float32)
        if per_channel
        else np.array(0.02, np.float32)
    )
    inits = {
        "xs": np.array(0.05, np.float32),
        "xz": np.array(117, np.uint8),
        "w": w,
        "ws": w_scale,
        "wz": np.zeros(o, np.int8) if per_channel else np.array(0, np.int8),
        "ys": np.array(0.3, np.float32),
        "yz": np.array(128, np.uint8),
        "b": g.integers(-3000, 3000, size=o, dtype=np.int32),
    }
    node = helper.make_node(
        "QLinearConv",
        ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"],
        ["y"],
        pads=[1, 1, 1, 1],
        strides=[stride, stride],
        group=group,
    )
    return make_model([node], {"x": x}, ["y"], inits)


@pytest.mark.parametrize("per_channel,group,stride", [(False, 1, 1), (True, 1, 2), (True, 8, 1)])
def test_qlinear_conv(per_channel, group, stride) -> None:
    g = rng(4)
    x = g.integers(0, 256, size=(2, 8, 10, 10), dtype=np.uint8)
    w = int8_weights(g, 8, 8 // group, 3, 3)
    model = qlinear_conv_model(x, w, per_channel, group, stride)
    (want,) = ort_run(model, {"x": x})
    (got,) = ember.compile_onnx(model)(x=x)
    assert_within_a_quantum(got, want)
    if group == 1:
        # Saturation at both ends happened, so the clamps are exercised.
        assert (want == 0).any() and (want == 255).any()


@pytest.mark.parametrize("b_type", [np.int8, np.uint8])
@pytest.mark.parametrize("batched", [False, True])
def test_qlinear_matmul(b_type, batched) -> None:
    g = rng(5)
    shape = (3, 7, 40) if batched else (7, 40)
    a = g.integers(0, 256, size=shape, dtype=np.uint8)
    inits = {
        "as": np.array(0.02, np.float32),
        "az": np.array(100, np.uint8),
        "b": int8_weights(g, 40, 12)
        if b_type == np.int8
        else g.integers(0, 256, size=(40, 12), dtype=b_type),
        "bs": np.array(0.03, np.float32),
        "bz": np.array(3, b_type),
        "ys": np.array(0.5, np.float32),
        "yz": np.array(10, np.uint8),
    }
    node = helper.make_node("QLinearMatMul", ["a", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"])
    model = make_model([node], {"a": a}, ["y"], inits)
    (want,) = ort_run(model, {"a": a})
    (got,) = ember.compile_onnx(model)(a=a)
    assert_within_a_quantum(got, want)


@pytest.mark.parametrize("output", ["quantized", "float"])
@pytest.mark.parametrize("per_column", [False, True])
def test_qgemm(output, per_column) -> None:
    g = rng(6)
    a = g.integers(0, 256, size=(6, 50), dtype=np.uint8)
    n = 9
    inits = {
        "as": np.array(0.02, np.float32),
        "az": np.array(90, np.uint8),
        # transB: the weight is stored [N, K], as quantize_static writes it.
        "b": int8_weights(g, n, 50),
        "bs": g.uniform(0.01, 0.04, size=n).astype(np.float32)
        if per_column
        else np.array(0.02, np.float32),
        "bz": np.zeros(n, np.int8) if per_column else np.array(0, np.int8),
        "c": g.integers(-5000, 5000, size=n, dtype=np.int32),
    }
    names = ["a", "as", "az", "b", "bs", "bz", "c"]
    if output == "quantized":
        inits |= {"ys": np.array(0.4, np.float32), "yz": np.array(120, np.uint8)}
        names += ["ys", "yz"]
    node = helper.make_node("QGemm", names, ["y"], domain=MS, transB=1, alpha=1.0)
    model = ms_model([node], {"a": a}, ["y"], inits)
    (want,) = ort_run(model, {"a": a})
    (got,) = ember.compile_onnx(model)(a=a)
    if output == "quantized":
        assert_within_a_quantum(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


def _quantize(x: np.ndarray, scale: float, zero: int) -> np.ndarray:
    return np.clip(np.round(x / scale) + zero, 0, 255).astype(np.uint8)


@pytest.mark.parametrize("op", ["QLinearAdd", "QLinearMul"])
def test_qlinear_binary(op) -> None:
    a = _quantize(randn(2, 4, 5, 5, seed=7), 0.03, 128)
    b = _quantize(randn(4, 1, 1, seed=8), 0.02, 100)
    inits = {
        "as": np.array(0.03, np.float32),
        "az": np.array(128, np.uint8),
        "b": b,
        "bs": np.array(0.02, np.float32),
        "bz": np.array(100, np.uint8),
        "cs": np.array(0.05, np.float32),
        "cz": np.array(125, np.uint8),
    }
    node = helper.make_node(op, ["a", "as", "az", "b", "bs", "bz", "cs", "cz"], ["y"], domain=MS)
    model = ms_model([node], {"a": a}, ["y"], inits)
    (want,) = ort_run(model, {"a": a})
    (got,) = ember.compile_onnx(model)(a=a)
    assert_within_a_quantum(got, want)


@pytest.mark.parametrize(
    "op,attrs",
    [
        ("QLinearSigmoid", {}),
        ("QLinearLeakyRelu", {"alpha": 0.1}),
        ("QLinearGlobalAveragePool", {"channels_last": 0}),
        ("QLinearGlobalAveragePool", {"channels_last": 1}),
        ("QLinearAveragePool", {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ],
)
def test_qlinear_unary(op, attrs) -> None:
    x = _quantize(randn(2, 6, 7, 7, seed=9) * 2, 0.04, 110)
    inits = {
        "xs": np.array(0.04, np.float32),
        "xz": np.array(110, np.uint8),
        "ys": np.array(0.03, np.float32),
        "yz": np.array(90, np.uint8),
    }
    node = helper.make_node(op, ["x", "xs", "xz", "ys", "yz"], ["y"], domain=MS, **attrs)
    model = ms_model([node], {"x": x}, ["y"], inits)
    (want,) = ort_run(model, {"x": x})
    (got,) = ember.compile_onnx(model)(x=x)
    assert_within_a_quantum(got, want)


def test_qlinear_concat() -> None:
    a = _quantize(randn(2, 3, 4, seed=10), 0.02, 128)
    b = _quantize(randn(2, 5, 4, seed=11), 0.05, 120)
    inits = {
        "ys": np.array(0.04, np.float32),
        "yz": np.array(127, np.uint8),
        "as": np.array(0.02, np.float32),
        "az": np.array(128, np.uint8),
        "bs": np.array(0.05, np.float32),
        "bz": np.array(120, np.uint8),
    }
    node = helper.make_node(
        "QLinearConcat", ["ys", "yz", "a", "as", "az", "b", "bs", "bz"], ["y"], domain=MS, axis=1
    )
    model = ms_model([node], {"a": a, "b": b}, ["y"], inits)
    (want,) = ort_run(model, {"a": a, "b": b})
    (got,) = ember.compile_onnx(model)(a=a, b=b)
    assert_within_a_quantum(got, want)


def test_max_pool_of_uint8() -> None:
    x = rng(12).integers(0, 256, size=(2, 3, 9, 9), dtype=np.uint8)
    model = single(
        "MaxPool", {"x": x}, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1] * 4}
    )
    check(model, {"x": x})


def test_unknown_microsoft_op_is_refused_by_name() -> None:
    x = randn(2, 4, seed=13)
    node = helper.make_node("SparseAttention", ["x", "x2"], ["y"], domain=MS, num_heads=1)
    model = ms_model([node], {"x": x, "x2": randn(4, 3, seed=14)}, ["y"], {})
    with pytest.raises(
        ember.UnsupportedOpError, match=r"com\.microsoft::SparseAttention.*FusedMatMul.*QGemm"
    ):
        ember.compile_onnx(model)


class SmallCnn(torch.nn.Module):
    """Conv, ReLU, MaxPool, a residual Add, depthwise Conv, Sigmoid·x, global pooling and
    a Linear: what QOperator quantization turns into QLinearConv, QLinearAdd, QLinearMul,
    QLinearSigmoid, QLinearGlobalAveragePool and QGemm."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.conv = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.depthwise = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.max_pool2d(torch.relu(self.stem(x)), 2)
        z = torch.relu(self.conv(y)) + y
        z = self.depthwise(z)
        z = torch.sigmoid(z) * z
        return self.head(torch.nn.functional.adaptive_avg_pool2d(z, 1).flatten(1))


def quantized_cnn(folder, fmt: str, per_channel: bool) -> onnx.ModelProto:
    """`SmallCnn` quantized by quantize_static in format `fmt`."""
    quantization = pytest.importorskip("onnxruntime.quantization")
    torch.manual_seed(0)
    src, dst = folder / "cnn.onnx", folder / f"cnn.{fmt}.onnx"
    torch.onnx.export(
        SmallCnn().eval(),
        (torch.randn(2, 3, 16, 16),),
        str(src),
        opset_version=17,
        dynamo=False,
        input_names=["x"],
    )

    quantization.quantize_static(
        str(src),
        str(dst),
        calibration([{"x": randn(2, 3, 16, 16, seed=s)} for s in range(4)]),
        quant_format=getattr(quantization.QuantFormat, fmt),
        per_channel=per_channel,
    )
    return onnx.load(str(dst))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["QOperator", "QDQ"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_statically_quantized_cnn(tmp_path, fmt, per_channel, backend) -> None:
    quantized = quantized_cnn(tmp_path, fmt, per_channel)
    ops = {n.op_type for n in quantized.graph.node}
    if fmt == "QOperator":
        assert {"QLinearConv", "QGemm", "QLinearAdd", "QLinearMul"} <= ops, ops
    x = randn(2, 3, 16, 16, seed=20)
    (want,) = ort_run(quantized, {"x": x})
    (got,) = compile_on(quantized, backend)(x=x)
    # The float output is a dequantized int8: allow one of its quanta, where a value sits
    # on a rounding boundary.
    step = np.min(np.diff(np.unique(want)))
    np.testing.assert_allclose(got, want, rtol=0, atol=step + 1e-6)


@pytest.mark.nvrtc
def test_quantized_cnn_kernels_compile_with_nvrtc(tmp_path) -> None:
    if not ember.cuda.cuda_built() or ember.cuda.nvrtc_version() is None:
        pytest.skip("no CUDA backend in this build, or libnvrtc not found")
    program = load_program(quantized_cnn(tmp_path, "QOperator", True))
    generated = ember.cuda.generated_source(program)
    assert generated["kernels"], "no kernels generated"
    for arch in ("sm_80", "sm_90"):
        assert ember.cuda.nvrtc_compile(generated["source"], arch) > 0
