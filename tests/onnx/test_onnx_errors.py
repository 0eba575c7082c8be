"""Bad models and bad inputs get clear ``ember`` exceptions, never a crash; ops that need IR
ops Ember lacks raise ``UnsupportedOpError`` naming the op and node; a bounded fuzz test of
mutated models finds no crash."""

from __future__ import annotations

import os

import ember
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_util import check, make_model, randn, single

X = randn(2, 3)


def test_missing_file(tmp_path) -> None:
    with pytest.raises(ember.CompileError, match="cannot read ONNX model"):
        ember.compile_onnx(tmp_path / "nope.onnx")


def test_bytes_that_are_not_onnx() -> None:
    with pytest.raises(ember.CompileError, match="not a valid ONNX model"):
        ember.compile_onnx(b"\x00\x01\x02 definitely not a protobuf \xff\xff")


def test_truncated_protobuf() -> None:
    model = single("MatMul", {"a": X}, initializers={"w": randn(3, 4, seed=1)})
    data = model.SerializeToString()
    with pytest.raises(ember.EmberError):
        ember.compile_onnx(data[: len(data) // 2])


def test_wrong_argument_type() -> None:
    with pytest.raises(TypeError, match="path, bytes or an onnx.ModelProto"):
        ember.compile_onnx(42)
    with pytest.raises(ValueError, match="device"):
        ember.compile_onnx(single("Relu", {"x": X}), device="tpu")


def test_unknown_op_names_op_and_node() -> None:
    node = helper.make_node("NoSuchOp", ["x"], ["y"], name="my_node")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(ember.UnsupportedOpError, match="'NoSuchOp' at node 'my_node'"):
        ember.compile_onnx(model)


@pytest.mark.parametrize(
    ("op", "inputs", "attrs"),
    [
        ("LpPool", ["x"], {"kernel_shape": [2]}),
        ("MaxUnpool", ["x", "i"], {"kernel_shape": [2]}),
        ("NonZero", ["x"], {}),
        ("Unique", ["x"], {}),
    ],
)
def test_ops_needing_new_ir_ops_are_unsupported(op, inputs, attrs) -> None:
    node = helper.make_node(op, inputs, ["y"], name=f"the_{op}", **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(ember.UnsupportedOpError, match=f"'{op}' at node 'the_{op}'"):
        ember.compile_onnx(model)


def test_unsupported_opset_and_domain() -> None:
    with pytest.raises(ember.CompileError, match="opset 26 is not supported"):
        ember.compile_onnx(single("Relu", {"x": X}, opset=26))
    node = helper.make_node("FusedGemm", ["x"], ["y"], domain="com.microsoft", name="fg")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
    )
    with pytest.raises(ember.UnsupportedOpError, match="com.microsoft::FusedGemm.*domain"):
        ember.compile_onnx(model)


def test_runtime_shape_input_is_unsupported() -> None:
    # A Reshape whose target shape is a runtime input cannot be folded to IR dims.
    model = single("Reshape", {"x": X, "s": np.array([3, 2], np.int64)})
    with pytest.raises(ember.UnsupportedOpError, match="Reshape.*compile time"):
        ember.compile_onnx(model)


def test_wrong_input_count_shape_and_dtype() -> None:
    runner = ember.compile_onnx(single("Add", {"a": X, "b": X}))
    with pytest.raises(ember.InputError, match="missing inputs"):
        runner(X)
    with pytest.raises(ember.InputError, match="takes 2 inputs"):
        runner(X, X, X)
    with pytest.raises(ember.InputError, match="unknown input"):
        runner(X, c=X)
    with pytest.raises(ember.InputError, match="shape"):
        runner(X, randn(3, 2))
    with pytest.raises(ember.InputError, match="float32"):
        runner(X, X.astype(np.float64))
    with pytest.raises(ember.InputError, match="numpy array or a torch tensor"):
        runner(X, [1.0])


def test_declared_output_type_mismatch() -> None:
    model = single("Relu", {"x": X})
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.INT64
    with pytest.raises(ember.CompileError, match="declared as int64"):
        ember.compile_onnx(model)


def _external_model(tmp_path, location: str) -> str:
    w = randn(3, 4, seed=1)
    model = single("MatMul", {"a": X}, initializers={"w": w})
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for k, v in {"location": location, "offset": "0", "length": str(w.nbytes)}.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = k, v
    path = tmp_path / "model" / "m.onnx"
    path.parent.mkdir(exist_ok=True)
    onnx.save(model, path)
    return str(path), w


def test_external_data_next_to_the_model(tmp_path) -> None:
    path, w = _external_model(tmp_path, "weights.bin")
    (tmp_path / "model" / "weights.bin").write_bytes(w.tobytes())
    runner = ember.compile_onnx(path)
    np.testing.assert_allclose(runner(X)[0], X @ w, rtol=1e-6, atol=1e-6)
    # As bytes, the external file cannot be found: a clear error, not a crash.
    with pytest.raises(ember.CompileError, match="load the model from its path"):
        ember.compile_onnx(open(path, "rb").read())


@pytest.mark.parametrize("location", ["../secret.bin", "/etc/passwd", "link.bin"])
def test_external_data_escaping_the_folder(tmp_path, location) -> None:
    path, w = _external_model(tmp_path, location)
    (tmp_path / "secret.bin").write_bytes(w.tobytes())
    os.symlink(tmp_path / "secret.bin", tmp_path / "model" / "link.bin")
    with pytest.raises(ember.CompileError, match="inside the model's folder"):
        ember.compile_onnx(path)


def test_external_data_too_short(tmp_path) -> None:
    path, w = _external_model(tmp_path, "weights.bin")
    (tmp_path / "model" / "weights.bin").write_bytes(w.tobytes()[:10])
    with pytest.raises(ember.CompileError, match="too few"):
        ember.compile_onnx(path)


def _fuzz_base() -> onnx.ModelProto:
    """A small model touching shapes, weights and several op families."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["h2"]),
        helper.make_node("Relu", ["h2"], ["r"]),
        helper.make_node("Shape", ["r"], ["s"]),
        helper.make_node("Reshape", ["r", "shape"], ["flat"]),
        helper.make_node("ReduceSum", ["flat", "axes"], ["y"], keepdims=0),
        helper.make_node("Softmax", ["r"], ["z"], axis=-1),
    ]
    inits = {
        "w": randn(3, 4, seed=1),
        "b": randn(4, seed=2),
        "shape": np.array([-1], np.int64),
        "axes": np.array([0], np.int64),
    }
    return make_model(nodes, {"x": randn(2, 3)}, ["y", "z"], inits)


def test_mutated_models_never_crash() -> None:
    base = _fuzz_base().SerializeToString()
    rng = np.random.default_rng(1234)
    outcomes = {"compiled": 0, "rejected": 0}
    for _ in range(60):
        data = bytearray(base)
        for _ in range(int(rng.integers(1, 6))):
            kind = rng.integers(0, 3)
            pos = int(rng.integers(0, len(data)))
            if kind == 0:
                data[pos] = int(rng.integers(0, 256))
            elif kind == 1:
                del data[pos : pos + int(rng.integers(1, 8))]
            else:
                data[pos:pos] = bytes(rng.integers(0, 256, size=int(rng.integers(1, 8))).tolist())
        try:
            runner = ember.compile_onnx(bytes(data))
        except ember.EmberError:
            outcomes["rejected"] += 1
            continue
        outcomes["compiled"] += 1
        feeds = []
        for dtype, name in zip(runner.input_dtypes, runner.input_names, strict=True):
            del name
            feeds.append(np.ones((2, 3), dtype=np.dtype(dtype)))
        try:
            runner(*feeds)
        except ember.EmberError:
            pass
    assert outcomes["compiled"] + outcomes["rejected"] == 60


def test_numpy_and_torch_in_out_and_names() -> None:
    import torch

    model = single("Sub", {"a": X, "b": randn(3, seed=1)})
    runner = ember.compile_onnx(model)
    assert runner.input_names == ["a", "b"]
    got = check(model, {"a": X, "b": randn(3, seed=1)}, compiled=runner)
    out = runner(b=torch.from_numpy(randn(3, seed=1)), a=torch.from_numpy(X))
    assert isinstance(out[0], torch.Tensor)
    np.testing.assert_array_equal(out[0].numpy(), got[0])
    # Non-contiguous and negatively strided numpy inputs.
    wide = randn(2, 6)
    np.testing.assert_array_equal(
        runner(wide[:, ::2], randn(3, seed=1)[::-1])[0], wide[:, ::2] - randn(3, seed=1)[::-1]
    )
    # numpy outputs are fresh arrays: a later call does not overwrite an earlier result.
    first = runner(X, randn(3, seed=1))[0]
    runner(X + 1, randn(3, seed=1))
    np.testing.assert_array_equal(first, got[0])
    assert first.flags.owndata and first.flags.writeable


def test_initializer_model_saved_as_file(tmp_path) -> None:
    w = numpy_helper.from_array(randn(3, 4, seed=1), "w")
    model = single("MatMul", {"a": X}, initializers={"w": numpy_helper.to_array(w)})
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    check(model, {"a": X}, compiled=ember.compile_onnx(path))


def test_batched_gather_nd_index_past_its_batch_is_an_error() -> None:
    # Row 4 of batch 0 does not exist (dim 1 has 4); it must not read batch 1's row 0.
    i = np.array([[[4]], [[0]], [[1]]], np.int64)
    model = single("GatherND", {"x": randn(3, 4, 5)}, {"batch_dims": 1}, initializers={"i": i})
    runner = ember.compile_onnx(model)
    with pytest.raises(ember.EmberError, match="out of range"):
        runner(randn(3, 4, 5))


def test_gather_nd_index_out_of_range_is_an_error() -> None:
    # [0, 7] is out of range for dim 1 (size 4) although 0 * 4 + 7 is a valid flat row.
    model = single("GatherND", {"x": randn(3, 4, 5)}, initializers={"i": np.array([[0, 7]])})
    runner = ember.compile_onnx(model)
    with pytest.raises(ember.EmberError, match="out of range"):
        runner(randn(3, 4, 5))
