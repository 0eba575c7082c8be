"""Conv, ConvTranspose, MaxPool and AveragePool built with ``onnx.helper`` and compared with
ONNX Runtime on random inputs, plus CNNs exported with ``torch.onnx.export``.

Tolerances: convolutions sum over C/groups·K taps in a different order than ONNX Runtime's
MLAS kernels, so they get rtol/atol 1e-5; pooling of max is exact and average nearly so. The
exported CNNs chain ~20 convs (and Ember folds batch norms into them), so errors compound:
1e-4."""

from __future__ import annotations

from typing import Any

import ember
import numpy as np
import onnx
import pytest
import torch
from ember.models import MobileNet, ResNet
from onnx_util import check, randn, single

TOL = {"rtol": 1e-5, "atol": 1e-5}


def conv_case(op: str, x: np.ndarray, w: np.ndarray, bias: bool, **attrs: Any) -> None:
    inits = {"w": w}
    if bias:
        inits["b"] = randn(w.shape[0] if op == "Conv" else w.shape[1] * attrs.get("group", 1))
    model = single(op, {"x": x}, attrs, 1, inits)
    check(model, {"x": x}, **TOL)


CONV = {
    "1d_pads_stride": (randn(2, 3, 11), randn(4, 3, 3, seed=1), {"strides": [2], "pads": [1, 2]}),
    "1d_dilation": (randn(1, 2, 13), randn(3, 2, 3, seed=1), {"dilations": [3]}),
    "2d_odd": (randn(2, 3, 9, 7), randn(5, 3, 3, 2, seed=1), {"strides": [2, 1]}),
    "2d_groups": (randn(1, 6, 8, 7), randn(4, 3, 3, 3, seed=1), {"group": 2, "pads": [1, 1, 1, 1]}),
    "2d_depthwise": (
        randn(2, 6, 9, 9),
        randn(6, 1, 3, 3, seed=1),
        {"group": 6, "strides": [2, 2], "pads": [1, 1, 1, 1]},
    ),
    "2d_asym_dilated": (
        randn(1, 3, 10, 9),
        randn(4, 3, 3, 3, seed=1),
        {"pads": [0, 2, 1, 0], "dilations": [2, 1], "kernel_shape": [3, 3]},
    ),
    "2d_same_upper": (
        randn(1, 3, 9, 8),
        randn(4, 3, 4, 3, seed=1),
        {"auto_pad": "SAME_UPPER", "strides": [2, 3]},
    ),
    "2d_same_lower": (
        randn(1, 3, 9, 8),
        randn(4, 3, 4, 3, seed=1),
        {"auto_pad": "SAME_LOWER", "strides": [2, 2]},
    ),
    "2d_valid": (randn(1, 3, 7, 8), randn(2, 3, 3, 3, seed=1), {"auto_pad": "VALID"}),
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", sorted(CONV))
def test_conv(name: str, bias: bool) -> None:
    x, w, attrs = CONV[name]
    conv_case("Conv", x, w, bias, **attrs)


CONV_T = {
    "1d": (randn(2, 3, 7), randn(3, 4, 3, seed=1), {}),
    "1d_stride2_outpad": (
        randn(1, 3, 6),
        randn(3, 2, 4, seed=1),
        {"strides": [2], "output_padding": [1], "pads": [1, 2]},
    ),
    "2d_stride2_outpad": (
        randn(2, 4, 5, 6),
        randn(4, 3, 3, 3, seed=1),
        {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]},
    ),
    "2d_groups_dilation": (
        randn(1, 4, 5, 5),
        randn(4, 3, 3, 2, seed=1),
        {"group": 2, "dilations": [2, 1], "strides": [1, 3], "pads": [0, 1, 2, 0]},
    ),
    "2d_big_pads": (randn(1, 2, 6, 6), randn(2, 2, 3, 3, seed=1), {"pads": [3, 2, 3, 4]}),
    "2d_output_shape": (
        randn(1, 3, 5, 4),
        randn(3, 2, 3, 4, seed=1),
        {"strides": [2, 2], "output_shape": [10, 8]},
    ),
    "1d_output_shape_odd": (
        randn(1, 2, 6),
        randn(2, 3, 4, seed=1),
        {"strides": [2], "output_shape": [13]},
    ),
    "2d_same_upper": (
        randn(1, 3, 5, 4),
        randn(3, 2, 3, 4, seed=1),
        {"strides": [2, 3], "auto_pad": "SAME_UPPER"},
    ),
    "2d_same_lower": (
        randn(1, 3, 5, 4),
        randn(3, 2, 3, 4, seed=1),
        {"strides": [2, 3], "auto_pad": "SAME_LOWER"},
    ),
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", sorted(CONV_T))
def test_conv_transpose(name: str, bias: bool) -> None:
    x, w, attrs = CONV_T[name]
    conv_case("ConvTranspose", x, w, bias, **attrs)


X1 = randn(2, 3, 11)
X2 = randn(2, 3, 9, 8)
POOL = {
    "1d": (X1, {"kernel_shape": [3], "strides": [2]}),
    "1d_ceil_asym": (X1, {"kernel_shape": [3], "strides": [2], "pads": [0, 1], "ceil_mode": 1}),
    "2d_sym": (X2, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "2d_ceil": (X2, {"kernel_shape": [3, 2], "strides": [2, 2], "ceil_mode": 1}),
    "2d_ceil_pads": (
        X2,
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1},
    ),
    "2d_asym": (X2, {"kernel_shape": [3, 3], "strides": [2, 1], "pads": [0, 1, 2, 1]}),
    "2d_asym_ceil": (
        X2,
        {"kernel_shape": [2, 3], "strides": [3, 2], "pads": [1, 0, 0, 1], "ceil_mode": 1},
    ),
    "2d_same_upper": (X2, {"kernel_shape": [3, 2], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    "2d_same_lower": (X2, {"kernel_shape": [3, 2], "strides": [2, 3], "auto_pad": "SAME_LOWER"}),
    "2d_valid": (X2, {"kernel_shape": [2, 2], "auto_pad": "VALID"}),
}


@pytest.mark.usefixtures("check_backend")
@pytest.mark.parametrize("name", sorted(POOL))
def test_max_pool(name: str) -> None:
    x, attrs = POOL[name]
    check(single("MaxPool", {"x": x}, attrs), {"x": x})


@pytest.mark.usefixtures("check_backend")
@pytest.mark.parametrize(
    "attrs",
    [
        {"kernel_shape": [3, 3], "dilations": [2, 1], "pads": [2, 1, 2, 1]},
        {"kernel_shape": [2, 2], "dilations": [2, 2], "strides": [2, 1], "ceil_mode": 1},
    ],
)
def test_max_pool_dilated(attrs: dict) -> None:
    check(single("MaxPool", {"x": X2}, attrs), {"x": X2})


@pytest.mark.usefixtures("check_backend")
@pytest.mark.parametrize("include", [0, 1])
@pytest.mark.parametrize("name", sorted(POOL))
def test_average_pool(name: str, include: int) -> None:
    x, attrs = POOL[name]
    model = single("AveragePool", {"x": x}, {**attrs, "count_include_pad": include})
    check(model, {"x": x})


def test_max_pool_indices_output_is_unsupported() -> None:
    model = single("MaxPool", {"x": X2}, {"kernel_shape": [2, 2]}, outputs=2)
    with pytest.raises(ember.UnsupportedOpError, match="'MaxPool' at node 'maxpool_node'.*Indices"):
        ember.compile_onnx(model)


def test_conv_transpose_output_shape_too_large_is_unsupported() -> None:
    x, w = randn(1, 2, 4, 4), randn(2, 2, 3, 3, seed=1)
    model = single("ConvTranspose", {"x": x}, {"output_shape": [9, 6]}, 1, {"w": w})
    with pytest.raises(ember.UnsupportedOpError, match="'ConvTranspose' at node.*output size 9"):
        ember.compile_onnx(model)


def test_conv_channel_mismatch_is_a_shape_error() -> None:
    x, w = randn(1, 3, 5, 5), randn(2, 4, 3, 3, seed=1)
    with pytest.raises(ember.ShapeError):
        ember.compile_onnx(single("Conv", {"x": x}, {}, 1, {"w": w}))


@pytest.mark.usefixtures("check_backend")
@pytest.mark.parametrize("name", ["ResNet", "MobileNet"])
def test_cnn_exported_from_torch(name: str, tmp_path) -> None:
    torch.manual_seed(0)
    model = ResNet(widths=(8, 16), classes=5) if name == "ResNet" else MobileNet(classes=5)
    x = torch.randn(2, 3, 32, 32)
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(model.eval(), (x,), str(path), opset_version=18, dynamo=True)
    check(onnx.load(str(path)), {"x": x.numpy()}, rtol=1e-4, atol=1e-4)
