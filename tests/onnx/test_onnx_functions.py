"""Model-local functions, inlined at each call: attribute references take the call's values
or the function's defaults, omitted optional inputs are absent in the body, calls nest; and
torch's `export_modules_as_functions`, checked against eager."""

from __future__ import annotations

import io
import warnings
from typing import Any

import ember
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from onnx_util import BACKENDS, check, compile_on, randn, tolerance

DOMAIN = "my.functions"


def attr_ref(name: str, ref: str, kind: int) -> onnx.AttributeProto:
    a = onnx.AttributeProto()
    a.name, a.ref_attr_name, a.type = name, ref, kind
    return a


def leaky_scale() -> onnx.FunctionProto:
    """`LeakyScale(x, s) = LeakyRelu(x, alpha=@slope) * s`, `slope` defaulting to 0.3."""
    leaky = helper.make_node("LeakyRelu", ["x"], ["l"])
    leaky.attribute.append(attr_ref("alpha", "slope", onnx.AttributeProto.FLOAT))
    f = helper.make_function(
        DOMAIN,
        "LeakyScale",
        ["x", "s"],
        ["y"],
        [leaky, helper.make_node("Mul", ["l", "s"], ["y"])],
        [helper.make_opsetid("", 18)],
        [],
    )
    f.attribute_proto.append(helper.make_attribute("slope", 0.3))
    return f


def bounded() -> onnx.FunctionProto:
    """`Bounded(x, lo, hi) = Clip(x, lo, hi)`, `hi` optional."""
    return helper.make_function(
        DOMAIN,
        "Bounded",
        ["x", "lo", "hi"],
        ["y"],
        [helper.make_node("Clip", ["x", "lo", "hi"], ["y"])],
        [helper.make_opsetid("", 18)],
        [],
    )


def twice() -> onnx.FunctionProto:
    """`Twice(x, s) = LeakyScale(LeakyScale(x, s, slope=0.5), s)`: calls nest."""
    inner = helper.make_node("LeakyScale", ["x", "s"], ["t"], domain=DOMAIN, slope=0.5)
    outer = helper.make_node("LeakyScale", ["t", "s"], ["y"], domain=DOMAIN)
    return helper.make_function(
        DOMAIN,
        "Twice",
        ["x", "s"],
        ["y"],
        [inner, outer],
        [helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)],
        [],
    )


def model_with(
    nodes: list[Any], functions: list[onnx.FunctionProto], inputs: dict[str, np.ndarray]
) -> onnx.ModelProto:
    ins = [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape) for k, v in inputs.items()]
    outs = [helper.make_empty_tensor_value_info(o) for n in nodes for o in n.output]
    graph = helper.make_graph(nodes, "g", ins, outs)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)],
        functions=functions,
    )
    model.ir_version = 10
    return model


@pytest.mark.parametrize("backend", BACKENDS)
def test_function_calls_take_the_calls_attributes_or_the_defaults(backend):
    x, s = randn(3, 4), randn(3, 4, seed=1)
    nodes = [
        helper.make_node("LeakyScale", ["x", "s"], ["a"], domain=DOMAIN, slope=0.1),
        helper.make_node("LeakyScale", ["x", "s"], ["b"], domain=DOMAIN),  # default 0.3
        helper.make_node("Twice", ["x", "s"], ["c"], domain=DOMAIN),
    ]
    model = model_with(nodes, [leaky_scale(), twice()], {"x": x, "s": s})
    feeds = {"x": x, "s": s}
    check(model, feeds, compiled=compile_on(model, backend), **tolerance(backend))


def test_an_omitted_optional_input_is_absent_in_the_body():
    x = randn(3, 4) * 3
    lo, hi = np.array(-1.0, np.float32), np.array(0.5, np.float32)
    nodes = [
        helper.make_node("Bounded", ["x", "lo", "hi"], ["both"], domain=DOMAIN),
        helper.make_node("Bounded", ["x", "lo"], ["below"], domain=DOMAIN),
    ]
    model = model_with(nodes, [bounded()], {"x": x, "lo": lo, "hi": hi})
    got = check(model, {"x": x, "lo": lo, "hi": hi})
    assert got[1].max() > 0.5  # no upper bound


def test_a_recursive_function_is_refused():
    f = helper.make_function(
        DOMAIN,
        "Forever",
        ["x"],
        ["y"],
        [helper.make_node("Forever", ["x"], ["y"], domain=DOMAIN)],
        [helper.make_opsetid(DOMAIN, 1)],
        [],
    )
    x = randn(2)
    model = model_with([helper.make_node("Forever", ["x"], ["y"], domain=DOMAIN)], [f], {"x": x})
    with pytest.raises(ember.UnsupportedOpError, match="recursive"):
        ember.compile_onnx(model)


def test_an_unsupported_op_inside_a_function_is_reported_with_its_path():
    f = helper.make_function(
        DOMAIN,
        "Uniq",
        ["x"],
        ["y"],
        [helper.make_node("Unique", ["x"], ["y"], name="u")],
        [helper.make_opsetid("", 18)],
        [],
    )
    x = randn(5)
    model = model_with(
        [helper.make_node("Uniq", ["x"], ["y"], name="call", domain=DOMAIN)], [f], {"x": x}
    )
    with pytest.raises(ember.UnsupportedOpError, match=r"Unique.*call/u"):
        ember.compile_onnx(model)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.nn.functional.gelu(self.lin(x))) + x


def test_modules_exported_as_functions_match_eager():
    """`export_modules_as_functions=True` writes every module as a function (model →
    Sequential → Block → Linear/LayerNorm), parameters passed in as inputs and attributes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block()).eval()
    x = torch.randn(3, 8)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (x,),
            buffer,
            dynamo=False,
            opset_version=17,
            input_names=["x"],
            export_modules_as_functions=True,
        )
    written = onnx.load_from_string(buffer.getvalue())
    assert len(written.functions) >= 3
    got = ember.compile_onnx(written)(x=x.numpy())[0]
    with torch.no_grad():
        want = model(x).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
