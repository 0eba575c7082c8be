"""ONNX Resize against ONNX Runtime: every mode, coordinate transformation and
nearest rounding, by scales and by sizes, up and down, plus the refusals."""

from __future__ import annotations

from typing import Any

import ember
import numpy as np
import pytest
from onnx_util import check, ints, randn, single

TOL = {"rtol": 1e-5, "atol": 1e-5}

CTMS = ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "half_pixel_symmetric"]


def resize_model(x: np.ndarray, scales=None, sizes=None, opset: int = 19, **attrs: Any):
    inits: dict[str, np.ndarray] = {}
    names = ["x", ""]
    if scales is not None:
        inits["scales"] = np.array(scales, dtype=np.float32)
        names.append("scales")
    else:
        names.append("")
        inits["sizes"] = np.array(sizes, dtype=np.int64)
        names.append("sizes")
    return single("Resize", {"x": x}, attrs, 1, inits, opset=opset, input_names=names)


@pytest.mark.usefixtures("check_backend")
@pytest.mark.parametrize("ctm", CTMS)
@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_up_by_scales(mode, ctm):
    x = randn(2, 3, 5, 4)
    model = resize_model(x, scales=[1, 1, 2.0, 1.5], mode=mode, coordinate_transformation_mode=ctm)
    check(model, {"x": x}, **TOL)


@pytest.mark.usefixtures("check_backend")
@pytest.mark.parametrize("ctm", CTMS)
@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_to_sizes_up_and_down(mode, ctm):
    x = randn(1, 2, 7, 6)
    model = resize_model(x, sizes=[1, 2, 4, 11], mode=mode, coordinate_transformation_mode=ctm)
    check(model, {"x": x}, **TOL)


ROUNDING = ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]


@pytest.mark.usefixtures("check_backend")
@pytest.mark.parametrize("nearest_mode", ROUNDING)
def test_resize_nearest_rounding(nearest_mode):
    x = randn(1, 1, 6, 5)
    model = resize_model(
        x,
        scales=[1, 1, 1.7, 0.6],
        mode="nearest",
        nearest_mode=nearest_mode,
        coordinate_transformation_mode="asymmetric",
    )
    check(model, {"x": x}, **TOL)


@pytest.mark.usefixtures("check_backend")
def test_resize_cubic_with_its_options():
    x = randn(1, 2, 6, 6)
    model = resize_model(
        x, scales=[1, 1, 1.5, 2.5], mode="cubic", cubic_coeff_a=-0.5, exclude_outside=1
    )
    check(model, {"x": x}, **TOL)


@pytest.mark.usefixtures("check_backend")
def test_resize_over_named_axes_and_integer_nearest():
    x = ints(2, 5, 3, low=0, high=100, dtype=np.int32)
    model = resize_model(x, sizes=[9, 2], axes=[1, 2], mode="nearest")
    check(model, {"x": x})


@pytest.mark.usefixtures("check_backend")
def test_resize_1d_and_3d_linear():
    x = randn(2, 3, 7)
    check(resize_model(x, scales=[1, 1, 2.5], mode="linear"), {"x": x}, **TOL)
    x = randn(1, 1, 3, 4, 5)
    check(resize_model(x, scales=[1, 1, 2, 1.5, 0.8], mode="linear"), {"x": x}, **TOL)


@pytest.mark.usefixtures("check_backend")
def test_resize_opset_13():
    x = randn(1, 2, 3, 4)
    check(resize_model(x, scales=[1, 1, 2, 3], opset=13, mode="linear"), {"x": x}, **TOL)


def test_resize_refuses_what_it_cannot_do():
    x = randn(1, 1, 4, 4)
    model = resize_model(x, scales=[1, 1, 0.5, 0.5], mode="linear", antialias=1)
    with pytest.raises(ember.UnsupportedOpError, match="antialias"):
        ember.compile_onnx(model)
    model = resize_model(
        x, scales=[1, 1, 2, 2], coordinate_transformation_mode="tf_crop_and_resize"
    )
    with pytest.raises(ember.UnsupportedOpError, match="tf_crop_and_resize"):
        ember.compile_onnx(model)


def test_resize_with_a_dynamic_batch_by_scales_and_by_sizes():
    """A dynamic batch dim keeps its size (scale 1, or a size read off the input's shape as
    exporters write it); one compiled model serves two batch sizes."""
    from onnx import helper
    from onnx_util import make_model

    x = randn(2, 3, 4, 5)
    by_scales = resize_model(x, scales=[1, 1, 2, 1.5], mode="linear")
    by_scales.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"], end=2),
        helper.make_node("Concat", ["shape", "spatial"], ["sizes"], axis=0),
        helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="nearest"),
    ]
    by_sizes = make_model(
        nodes,
        {"x": x},
        ["y"],
        {"spatial": np.array([7, 3], np.int64)},
        input_shapes={"x": ["batch", 3, 4, 5]},
    )
    for model in (by_scales, by_sizes):
        compiled = ember.compile_onnx(model)
        for batch in (2, 5):
            check(model, {"x": randn(batch, 3, 4, 5, seed=batch)}, compiled=compiled, **TOL)
    # Resizing the dynamic dim itself is refused.
    grow_batch = resize_model(x, scales=[2, 1, 1, 1], mode="nearest")
    grow_batch.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    with pytest.raises(ember.UnsupportedOpError, match="symbolic input shape"):
        ember.compile_onnx(grow_batch)
