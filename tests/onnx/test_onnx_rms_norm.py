"""RMS norm as exporters write it (no ONNX op before opset 23) runs as one fused RmsNorm,
with the results of the decomposed graph (checked against ONNX Runtime and eager)."""

from __future__ import annotations

import ember
import numpy as np
import pytest
import torch
from onnx import helper
from onnx_util import check, make_model, randn


def _rms_model(form: str, weighted: bool):
    x = randn(2, 5, 16, seed=4) * 3
    inits = {
        "two": np.array(2.0, dtype=np.float32),
        "eps": np.array(1e-5, dtype=np.float32),
        "axes": np.array([-1], dtype=np.int64),
        "w": randn(16, seed=5),
    }
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
        helper.make_node("Add", ["eps", "ms"], ["ms_eps"]),
        helper.make_node("Sqrt", ["ms_eps"], ["root"]),
    ]
    if form == "recip":  # torch's exporter: x · 1/sqrt(..)
        nodes += [
            helper.make_node("Reciprocal", ["root"], ["inv"]),
            helper.make_node("Mul", ["inv", "x"], ["normed"]),
        ]
    else:
        nodes.append(helper.make_node("Div", ["x", "root"], ["normed"]))
    out = "normed"
    if weighted:
        nodes.append(helper.make_node("Mul", ["w", "normed"], ["out"]))
        out = "out"
    return make_model(nodes, {"x": x}, [out], initializers=inits), {"x": x}


@pytest.mark.parametrize("form", ["recip", "div"])
@pytest.mark.parametrize("weighted", [False, True])
def test_decomposed_rms_norm_runs_fused(form: str, weighted: bool) -> None:
    model, feeds = _rms_model(form, weighted)
    compiled = ember.compile_onnx(model)
    check(model, feeds, rtol=1e-5, atol=1e-5, compiled=compiled)
    ir = compiled.ir()
    assert "rms_norm(" in ir and "sqrt(" not in ir, ir
    assert ("rms_norm(%0, %1)" in ir) == weighted, ir


def test_rms_norm_written_out_in_torch_runs_fused() -> None:
    """Llama's RMSNorm module as Hugging Face writes it, traced by torch.export."""

    class RMSNorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(24))

        def forward(self, x):
            variance = x.pow(2).mean(-1, keepdim=True)
            return self.weight * (x * torch.rsqrt(variance + 1e-6))

    model = RMSNorm().eval()
    x = torch.randn(3, 7, 24) * 4
    compiled = ember.compile(model, x)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert "rms_norm(" in compiled.ir()


def test_a_mean_over_the_wrong_count_stays_decomposed() -> None:
    """Sum of squares divided by a count that is not the row length: not an RMS norm."""
    x = randn(4, 8, seed=6)
    inits = {
        "n": np.array(7.0, dtype=np.float32),
        "eps": np.array(1e-5, dtype=np.float32),
        "axes": np.array([-1], dtype=np.int64),
    }
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["sq"]),
        helper.make_node("ReduceSum", ["sq", "axes"], ["s"], keepdims=1),
        helper.make_node("Div", ["s", "n"], ["ms"]),
        helper.make_node("Add", ["ms", "eps"], ["ms_eps"]),
        helper.make_node("Sqrt", ["ms_eps"], ["root"]),
        helper.make_node("Div", ["x", "root"], ["out"]),
    ]
    model = make_model(nodes, {"x": x}, ["out"], initializers=inits)
    compiled = ember.compile_onnx(model)
    check(model, {"x": x}, rtol=1e-5, atol=1e-5, compiled=compiled)
    assert "rms_norm(" not in compiled.ir()
