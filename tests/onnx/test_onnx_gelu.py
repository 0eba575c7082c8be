"""GELU as exporters wrote it before opset 20 (`Div √2 → Erf → Add 1 → Mul x → Mul 0.5`, in
some order) runs as one fused gelu, and the tanh approximation written out (GPT-2's
`gelu_new`) as one gelu_tanh, with the results of the decomposed graph (checked against ONNX
Runtime and eager)."""

from __future__ import annotations

import io
import math

import ember
import numpy as np
import onnx
import pytest
import torch
from onnx import helper
from onnx_util import check, make_model, randn


def _gelu_model(form: str, root: float = math.sqrt(2.0)):
    x = randn(3, 40, seed=7) * 3
    inits = {
        "root": np.array(root, dtype=np.float32),
        "inv_root": np.array(1.0 / root, dtype=np.float32),
        "one": np.array(1.0, dtype=np.float32),
        "half": np.array(0.5, dtype=np.float32),
    }
    if form == "torch":  # torch's TorchScript exporter
        nodes = [
            helper.make_node("Div", ["x", "root"], ["t"]),
            helper.make_node("Erf", ["t"], ["e"]),
            helper.make_node("Add", ["e", "one"], ["s"]),
            helper.make_node("Mul", ["x", "s"], ["p"]),
            helper.make_node("Mul", ["p", "half"], ["out"]),
        ]
    else:  # x · 0.5 first, the scale as a product, operands swapped
        nodes = [
            helper.make_node("Mul", ["half", "x"], ["h"]),
            helper.make_node("Mul", ["inv_root", "x"], ["t"]),
            helper.make_node("Erf", ["t"], ["e"]),
            helper.make_node("Add", ["one", "e"], ["s"]),
            helper.make_node("Mul", ["s", "h"], ["out"]),
        ]
    return make_model(nodes, {"x": x}, ["out"], initializers=inits), {"x": x}


@pytest.mark.parametrize("form", ["torch", "hf"])
def test_decomposed_gelu_runs_fused(form: str) -> None:
    model, feeds = _gelu_model(form)
    compiled = ember.compile_onnx(model)
    check(model, feeds, rtol=1e-5, atol=1e-5, compiled=compiled)
    ir = compiled.ir()
    assert "gelu(" in ir and "erf(" not in ir, ir


def test_another_erf_scale_stays_decomposed() -> None:
    model, feeds = _gelu_model("torch", root=2.0)
    compiled = ember.compile_onnx(model)
    check(model, feeds, rtol=1e-5, atol=1e-5, compiled=compiled)
    assert "gelu(" not in compiled.ir() and "erf(" in compiled.ir()


def test_legacy_exported_gelu_runs_fused() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU()).eval()
    x = torch.randn(5, 16)
    buf = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(model, (x,), buf, opset_version=14, dynamo=False)
    proto = onnx.load_from_string(buf.getvalue())
    assert "Erf" in {n.op_type for n in proto.graph.node}
    compiled = ember.compile_onnx(proto)
    check(proto, {proto.graph.input[0].name: x.numpy()}, rtol=1e-5, atol=1e-5, compiled=compiled)
    assert "gelu(" in compiled.ir() and "erf(" not in compiled.ir()


def test_gelu_written_out_in_torch_runs_fused() -> None:
    """Older Hugging Face models' `gelu`, traced by torch.export."""

    class Gelu(torch.nn.Module):
        def forward(self, x):
            return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))

    x = torch.randn(4, 33) * 3
    compiled = ember.compile(Gelu(), x)
    torch.testing.assert_close(compiled(x), Gelu()(x), rtol=1e-5, atol=1e-5)
    assert "gelu(" in compiled.ir() and "erf(" not in compiled.ir()


def _tanh_gelu_model(cube: str, coefficient: float = 0.044715):
    """GPT-2's `gelu_new` as the TorchScript exporter writes it (`Pow 3`) or with the cube as
    two products."""
    x = randn(3, 40, seed=11) * 3
    inits = {
        "three": np.array(3.0, dtype=np.float32),
        "a": np.array(coefficient, dtype=np.float32),
        "k": np.array(math.sqrt(2.0 / math.pi), dtype=np.float32),
        "one": np.array(1.0, dtype=np.float32),
        "half": np.array(0.5, dtype=np.float32),
    }
    if cube == "pow":
        cubed = [helper.make_node("Pow", ["x", "three"], ["c"])]
    else:
        cubed = [
            helper.make_node("Mul", ["x", "x"], ["sq"]),
            helper.make_node("Mul", ["sq", "x"], ["c"]),
        ]
    nodes = [
        helper.make_node("Mul", ["half", "x"], ["h"]),
        *cubed,
        helper.make_node("Mul", ["c", "a"], ["ac"]),
        helper.make_node("Add", ["x", "ac"], ["inner"]),
        helper.make_node("Mul", ["k", "inner"], ["t"]),
        helper.make_node("Tanh", ["t"], ["th"]),
        helper.make_node("Add", ["one", "th"], ["s"]),
        helper.make_node("Mul", ["h", "s"], ["out"]),
    ]
    return make_model(nodes, {"x": x}, ["out"], initializers=inits), {"x": x}


@pytest.mark.parametrize("cube", ["pow", "products"])
def test_decomposed_tanh_gelu_runs_fused(cube: str) -> None:
    model, feeds = _tanh_gelu_model(cube)
    compiled = ember.compile_onnx(model)
    check(model, feeds, rtol=1e-5, atol=1e-5, compiled=compiled)
    ir = compiled.ir()
    assert "gelu_tanh(" in ir and "tanh(x" not in ir and "pow(" not in ir, ir


def test_another_tanh_coefficient_stays_decomposed() -> None:
    model, feeds = _tanh_gelu_model("pow", coefficient=0.05)
    compiled = ember.compile_onnx(model)
    check(model, feeds, rtol=1e-5, atol=1e-5, compiled=compiled)
    assert "gelu_tanh(" not in compiled.ir()


def test_gpt2_gelu_new_in_torch_runs_fused() -> None:
    """Hugging Face's `NewGELUActivation` (GPT-2, GPT-J, Phi's `gelu_new`), traced by
    torch.export."""

    class GeluNew(torch.nn.Module):
        def forward(self, x):
            inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
            return 0.5 * x * (1.0 + torch.tanh(inner))

    x = torch.randn(4, 33) * 3
    compiled = ember.compile(GeluNew(), x)
    torch.testing.assert_close(compiled(x), GeluNew()(x), rtol=1e-5, atol=1e-5)
    assert "gelu_tanh(" in compiled.ir(), compiled.ir()
