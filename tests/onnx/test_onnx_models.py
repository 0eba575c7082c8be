"""Models exported from torch with ``torch.onnx.export`` (an MLP, a transformer block) and
hand-built shape arithmetic, compiled once and run at two sizes of a dynamic dim; compared
with ONNX Runtime and eager torch.

Tolerances: matrix products and layer norms accumulate in a different order than ONNX
Runtime's MLAS kernels, so model outputs get rtol/atol 1e-5 (≈ 2⁻¹⁷, a few fp32 ulps per
reduction step over these sizes)."""

from __future__ import annotations

import ember
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from onnx_util import check, make_model, randn

TOL = {"rtol": 1e-5, "atol": 1e-5}


def export(module: torch.nn.Module, example: torch.Tensor, dims: dict[int, str], path) -> str:
    torch.manual_seed(0)
    shapes = ({i: torch.export.Dim(name, min=2, max=64) for i, name in dims.items()},)
    torch.onnx.export(
        module.eval(), (example,), path, dynamic_shapes=shapes, opset_version=18, verbose=False
    )
    return str(path)


class Block(torch.nn.Module):
    """A pre-norm transformer block with causal attention written out op by op."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.ff = torch.nn.Sequential(
            torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        att = torch.softmax(scores, dim=-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.ff(self.norm2(x))


@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory) -> str:
    mlp = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8), torch.nn.Softmax(-1)
    )
    return export(mlp, torch.randn(4, 16), {0: "batch"}, tmp_path_factory.mktemp("m") / "m.onnx")


@pytest.fixture(scope="module")
def block() -> Block:
    torch.manual_seed(0)
    return Block().eval()


@pytest.fixture(scope="module")
def block_path(block, tmp_path_factory) -> str:
    return export(block, torch.randn(2, 8, 32), {1: "seq"}, tmp_path_factory.mktemp("b") / "b.onnx")


def test_mlp_dynamic_batch(mlp_path) -> None:
    model = onnx.load(mlp_path)
    runner = ember.compile_onnx(mlp_path)
    (name,) = runner.input_names
    for batch in (3, 11):
        check(model, {name: randn(batch, 16, seed=batch)}, compiled=runner, **TOL)
    with pytest.raises(ember.InputError):
        runner(randn(3, 15))


def test_transformer_block_two_lengths(block, block_path) -> None:
    model = onnx.load(block_path)
    runner = ember.compile_onnx(block_path)
    (name,) = runner.input_names
    for seq in (5, 13):
        x = randn(2, seq, 32, seed=seq)
        got = check(model, {name: x}, compiled=runner, **TOL)
        with torch.no_grad():
            want = block(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(got[0], want, **TOL)
    with pytest.raises(ember.InputError):
        runner(randn(3, 5, 32))  # the batch was exported as a constant 2


def test_torch_tensors_in_torch_out(block_path) -> None:
    runner = ember.compile_onnx(block_path)
    out = runner(torch.randn(2, 6, 32))
    assert isinstance(out[0], torch.Tensor) and out[0].shape == (2, 6, 32)


def test_symbolic_shape_arithmetic_runs_at_two_sizes() -> None:
    """Shape → Gather → Mul → Concat → Reshape on a dim_param folds into IR dims; one
    compiled model serves two batch sizes."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
        helper.make_node("Mul", ["b", "two"], ["b2"]),
        helper.make_node("Concat", ["b2", "minus1"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["r"]),
        helper.make_node("Softmax", ["r"], ["y"], axis=-1),
        helper.make_node("Size", ["x"], ["n"]),
    ]
    inits = {
        "zero": np.array([0], np.int64),
        "two": np.array([2], np.int64),
        "minus1": np.array([-1], np.int64),
    }
    x = randn(3, 4, 6)
    model = make_model(nodes, {"x": x}, ["y", "n"], inits, input_shapes={"x": ["B", 4, 6]})
    runner = ember.compile_onnx(model)
    assert "B" in runner.ir()
    for batch in (3, 7):
        check(model, {"x": randn(batch, 4, 6, seed=batch)}, compiled=runner)
    with pytest.raises(ember.InputError):
        runner(randn(3, 5, 6))


@pytest.mark.usefixtures("check_backend")
def test_sizes_computed_from_constants_by_float_math_or_2d_detours_are_folded() -> None:
    """Exporters compute static sizes in ways shape folding does not follow: a reshape's
    size as `Cast(Ceil(Div(Cast(n, float), k)) * k)` (MobileViT) and Pad's pads through a
    2-d reshape, reversed slice and transpose (torch's `F.pad`, Swin). Everything behind
    them is constant, so the interpreter evaluates them while translating."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    nodes = [
        # size = ceil(6 / 4) * 4 = 8, computed in float.
        helper.make_node("Cast", ["six"], ["six_f"], to=f),
        helper.make_node("Div", ["six_f", "four_f"], ["q"]),
        helper.make_node("Ceil", ["q"], ["c"]),
        helper.make_node("Mul", ["c", "four_f"], ["size_f"]),
        helper.make_node("Cast", ["size_f"], ["size"], to=i64),
        # torch's pad list (0, size - 6, 0, 0) turned into ONNX pads through 2-d, as its
        # exporter writes it.
        helper.make_node("Sub", ["size", "six"], ["extra"]),
        helper.make_node("Concat", ["zero1", "extra", "zeros2"], ["flat"], axis=0),
        helper.make_node("Reshape", ["flat", "pairs"], ["p2"]),
        helper.make_node("Slice", ["p2", "m1", "big", "zero1", "m1"], ["rev"]),
        helper.make_node("Transpose", ["rev"], ["t"], perm=[1, 0]),
        helper.make_node("Reshape", ["t", "m1"], ["pads"]),
        helper.make_node("Pad", ["x", "pads"], ["padded"]),
        helper.make_node("Concat", ["three", "size"], ["shape"], axis=0),
        helper.make_node("Reshape", ["padded", "shape"], ["y"]),
    ]
    inits = {
        "six": np.array([6], np.int64),
        "four_f": np.array([4.0], np.float32),
        "zeros2": np.array([0, 0], np.int64),
        "zero1": np.array([0], np.int64),
        "pairs": np.array([2, 2], np.int64),
        "m1": np.array([-1], np.int64),
        "big": np.array([-(2**62)], np.int64),
        "three": np.array([3], np.int64),
    }
    x = randn(3, 6)
    model = make_model(nodes, {"x": x}, ["y"], inits)
    got = check(model, {"x": x})
    assert got[0].shape == (3, 8)


def test_torchscript_export_shape_chains(block, tmp_path) -> None:
    """The TorchScript exporter spells reshapes as Shape → Gather → Unsqueeze → Concat chains;
    with batch and sequence both dynamic they must fold into symbolic IR dims."""
    path = tmp_path / "ts.onnx"
    try:
        torch.onnx.export(
            block,
            (torch.randn(2, 8, 32),),
            path,
            dynamo=False,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "batch", 1: "seq"}},
            opset_version=17,
        )
    except Exception as e:  # noqa: BLE001 - the legacy exporter may be gone in a torch release
        pytest.skip(f"TorchScript ONNX export unavailable: {e}")
    model = onnx.load(path)
    assert {"Shape", "Gather", "Concat"} <= {n.op_type for n in model.graph.node}
    runner = ember.compile_onnx(model)
    for batch, seq in ((2, 5), (3, 11)):
        check(model, {"x": randn(batch, seq, 32, seed=seq)}, compiled=runner, **TOL)
