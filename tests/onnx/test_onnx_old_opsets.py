"""Models of ai.onnx opsets older than 13 are converted by `onnx.version_converter` before
translation, with the old semantics kept: checked against ONNX Runtime running the original
model, and a CNN exported by torch at opset 11 against eager."""

from __future__ import annotations

import warnings

import ember
import ember.models
import numpy as np
import onnx
import pytest
import torch
from onnx import helper
from onnx_util import check, make_model, ort_run, randn, single


@pytest.mark.usefixtures("check_backend")
def test_opset_11_softmax_keeps_its_flattening_semantics():
    # Before opset 13, Softmax(axis=1) on [2, 3, 4] normalizes over the 12 trailing elements.
    x = randn(2, 3, 4)
    model = single("Softmax", {"x": x}, {"axis": 1}, opset=11)
    check(model, {"x": x})


@pytest.mark.usefixtures("check_backend")
def test_opset_9_upsample_and_opset_10_slice():
    x = randn(1, 2, 3, 3)
    upsample = make_model(
        [helper.make_node("Upsample", ["x", "scales"], ["y"], mode="nearest")],
        {"x": x},
        ["y"],
        initializers={"scales": np.array([1, 1, 2, 2], np.float32)},
        opset=9,
    )
    check(upsample, {"x": x})
    starts, ends = np.array([1], np.int64), np.array([3], np.int64)
    sliced = single("Slice", {"x": x}, initializers={"s": starts, "e": ends}, opset=10)
    check(sliced, {"x": x})


def test_an_opset_11_cnn_exported_by_torch_matches_eager(tmp_path):
    torch.manual_seed(0)
    model = ember.models.ResNet().eval()
    x = torch.randn(1, 3, 32, 32)
    path = tmp_path / "resnet11.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=11)
    assert onnx.load(str(path)).opset_import[0].version == 11
    got = ember.compile_onnx(str(path))(x.numpy())[0]
    with torch.no_grad():
        want = model(x).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("check_backend")
def test_the_callers_model_is_not_changed_by_the_conversion():
    x = randn(2, 3)
    model = single("Relu", {"x": x}, opset=11)
    before = model.SerializeToString()
    check(model, {"x": x})
    assert model.SerializeToString() == before
    assert ort_run(model, {"x": x})[0].shape == (2, 3)


def test_a_model_the_converter_cannot_convert_is_refused_naming_it():
    # Opset 1 has no adapter path for this op's version; the converter says so.
    x = randn(2, 3)
    model = single("Relu", {"x": x}, opset=1)
    model.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(ember.CompileError, match="could not convert it to 13"):
        ember.compile_onnx(model)


def test_an_old_model_with_external_data_is_refused_with_the_way_out(tmp_path):
    x = randn(2, 16)
    model = make_model(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        {"x": x},
        ["y"],
        initializers={"w": randn(2, 16, seed=1)},
        opset=11,
    )
    path = tmp_path / "old.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, size_threshold=0)
    with pytest.raises(ember.CompileError, match="external data.*convert_version"):
        ember.compile_onnx(str(path))
