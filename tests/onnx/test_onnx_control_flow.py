"""If, Loop and Scan against ONNX Runtime: branches taken at compile time or selected at run
time, loops unrolled with their carried values, scan outputs and masked iterations, and the
refusals where the iteration count or a select's shape depends on values."""

from __future__ import annotations

import io
import warnings
from typing import Any

import ember
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx_util import BACKENDS, check, compile_on, make_model, ort_run, randn, tolerance

F = TensorProto.FLOAT


def graph(nodes: list[Any], name: str, inputs: list[Any], outputs: list[Any], inits=None) -> Any:
    return helper.make_graph(nodes, name, inputs, outputs, initializer=inits or [])


def vi(name: str, elem: int = F, shape: list[Any] | None = None) -> Any:
    return helper.make_tensor_value_info(name, elem, shape)


def branches() -> tuple[Any, Any]:
    """then: x + w (w from the outer scope); else: x * 3 (a constant of its own)."""
    then_g = graph([helper.make_node("Add", ["x", "w"], ["t"])], "then", [], [vi("t")])
    three = numpy_helper.from_array(np.array(3.0, np.float32), "three")
    else_g = graph([helper.make_node("Mul", ["x", "three"], ["e"])], "else", [], [vi("e")], [three])
    return then_g, else_g


@pytest.mark.parametrize("taken", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_if_with_a_known_condition_translates_only_the_taken_branch(taken, backend):
    then_g, else_g = branches()
    x, w = randn(2, 5), randn(2, 5, seed=1)
    model = make_model(
        [helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)],
        {"x": x},
        ["y"],
        initializers={"w": w, "c": np.array(taken)},
    )
    check(model, {"x": x}, compiled=compile_on(model, backend), **tolerance(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_if_decided_at_run_time_selects_the_taken_branch(backend):
    then_g, else_g = branches()
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["c"]),
        helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g),
    ]
    x = randn(2, 5)
    model = make_model(
        nodes, {"x": x}, ["y"], initializers={"w": randn(2, 5, seed=1), "zero": np.float32(0)}
    )
    compiled = compile_on(model, backend)
    for sign in (1.0, -1.0):  # both branches, from one compiled model
        feed = {"x": np.abs(x) * sign}
        check(model, feed, compiled=compiled, **tolerance(backend))


def test_if_on_a_shape_comparison_folds_for_each_static_shape():
    """`If(Equal(Shape(x)[0], 1))`: the kind of test exporters leave for batch-1 paths."""
    then_g = graph([helper.make_node("Neg", ["x"], ["t"])], "then", [], [vi("t")])
    else_g = graph([helper.make_node("Exp", ["x"], ["e"])], "else", [], [vi("e")])
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
        helper.make_node("Equal", ["batch", "one"], ["c"]),
        helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g),
    ]
    for batch in (1, 3):
        x = randn(batch, 4)
        model = make_model(
            nodes,
            {"x": x},
            ["y"],
            initializers={"zero": np.array(0, np.int64), "one": np.array(1, np.int64)},
        )
        check(model, {"x": x})


def test_nested_ifs_read_values_of_every_enclosing_scope():
    inner_then = graph([helper.make_node("Add", ["t0", "x"], ["t1"])], "it", [], [vi("t1")])
    inner_else = graph([helper.make_node("Sub", ["t0", "x"], ["t2"])], "ie", [], [vi("t2")])
    outer_then = graph(
        [
            helper.make_node("Mul", ["x", "x"], ["t0"]),
            helper.make_node("If", ["c2"], ["r"], then_branch=inner_then, else_branch=inner_else),
        ],
        "ot",
        [],
        [vi("r")],
    )
    outer_else = graph([helper.make_node("Identity", ["x"], ["o"])], "oe", [], [vi("o")])
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
        helper.make_node("Greater", ["m", "zero"], ["c2"]),
        helper.make_node("If", ["c1"], ["y"], then_branch=outer_then, else_branch=outer_else),
    ]
    x = randn(3, 4)
    model = make_model(
        nodes, {"x": x}, ["y"], initializers={"c1": np.array(True), "zero": np.float32(0)}
    )
    compiled = ember.compile_onnx(model)
    check(model, {"x": x}, compiled=compiled)
    check(model, {"x": -np.abs(x)}, compiled=compiled)


def test_if_decided_at_run_time_with_branches_of_different_shapes_is_refused():
    then_g = graph([helper.make_node("Identity", ["x"], ["t"])], "then", [], [vi("t")])
    else_g = graph([helper.make_node("ReduceSum", ["x"], ["e"], keepdims=1)], "else", [], [vi("e")])
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["c"]),
        helper.make_node("If", ["c"], ["y"], name="pick", then_branch=then_g, else_branch=else_g),
    ]
    x = randn(2, 3)
    model = make_model(nodes, {"x": x}, ["y"], initializers={"zero": np.float32(0)})
    with pytest.raises(ember.UnsupportedOpError, match=r"(?s)If.*pick.*differ"):
        ember.compile_onnx(model)


def counting_body(stop_after: int | None = None) -> Any:
    """`(i, cond, y) -> (cond', y * a + i, y)`: the carried value updated by the iteration
    number; `cond'` is `i < stop_after` when given (a condition known while unrolling)."""
    nodes = [
        helper.make_node("Cast", ["i"], ["fi"], to=F),
        helper.make_node("Mul", ["y_in", "a"], ["ya"]),
        helper.make_node("Add", ["ya", "fi"], ["y_out"]),
        helper.make_node("Identity", ["y_in"], ["scan"]),
    ]
    if stop_after is None:
        nodes.append(helper.make_node("Identity", ["cond_in"], ["cond_out"]))
    else:
        stop = numpy_helper.from_array(np.array(stop_after, np.int64), "stop")
        nodes.append(helper.make_node("Less", ["i", "stop"], ["cond_out"]))
    return graph(
        nodes,
        "body",
        [vi("i", TensorProto.INT64, []), vi("cond_in", TensorProto.BOOL, []), vi("y_in")],
        [vi("cond_out", TensorProto.BOOL, []), vi("y_out"), vi("scan")],
        [] if stop_after is None else [stop],
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_loop_with_a_trip_count_unrolls_carried_values_and_scan_outputs(backend):
    y0, a = randn(2, 3), randn(2, 3, seed=1)
    model = make_model(
        [helper.make_node("Loop", ["M", "", "y0"], ["y", "ys"], body=counting_body())],
        {"y0": y0, "a": a},
        ["y", "ys"],
        initializers={"M": np.array(5, np.int64)},
    )
    got = check(model, {"y0": y0, "a": a}, compiled=compile_on(model, backend))
    assert got[1].shape == (5, 2, 3)


def test_loop_stops_where_a_known_body_condition_turns_false():
    y0, a = randn(4), randn(4, seed=1)
    model = make_model(
        [
            helper.make_node(
                "Loop", ["M", "go", "y0"], ["y", "ys"], body=counting_body(stop_after=2)
            )
        ],
        {"y0": y0, "a": a},
        ["y", "ys"],
        initializers={"M": np.array(10, np.int64), "go": np.array(True)},
    )
    got = check(model, {"y0": y0, "a": a})
    assert got[1].shape == (3, 4)  # iterations 0, 1, 2; the condition after 2 is false


def test_loop_whose_condition_is_decided_at_run_time_stops_per_input():
    """A while loop with a bound: `y = 2 y` while `sum(y) < limit`, at most 6 times."""
    body = graph(
        [
            helper.make_node("Add", ["y_in", "y_in"], ["y_out"]),
            helper.make_node("ReduceSum", ["y_out"], ["s"], keepdims=0),
            helper.make_node("Less", ["s", "limit"], ["cond_out"]),
        ],
        "body",
        [vi("i", TensorProto.INT64, []), vi("cond_in", TensorProto.BOOL, []), vi("y_in")],
        [vi("cond_out", TensorProto.BOOL, []), vi("y_out")],
    )
    y0 = np.abs(randn(3)) + 0.1
    model = make_model(
        [helper.make_node("Loop", ["M", "go", "y0"], ["y"], body=body)],
        {"y0": y0, "limit": np.array(0, np.float32)},
        ["y"],
        initializers={"M": np.array(6, np.int64), "go": np.array(True)},
    )
    compiled = ember.compile_onnx(model)
    s = float(y0.sum())
    for limit in (0.0, 3 * s, 9 * s, 1000 * s):  # stops after 1, 2, 4 and 6 iterations
        check(model, {"y0": y0, "limit": np.array(limit, np.float32)}, compiled=compiled)


def test_loops_ember_cannot_unroll_are_refused_naming_the_node():
    y0 = randn(3)
    runtime_count = make_model(
        [helper.make_node("Loop", ["M", "", "y0"], ["y", "ys"], name="lp", body=counting_body())],
        {"y0": y0, "a": y0, "M": np.array(3, np.int64)},
        ["y", "ys"],
    )
    with pytest.raises(ember.UnsupportedOpError, match=r"(?s)Loop.*lp.*trip count"):
        ember.compile_onnx(runtime_count)

    # The body's condition depends on y: the number of scan slices would depend on values.
    body = counting_body()
    body.node[-1].CopyFrom(helper.make_node("Greater", ["s", "zero"], ["cond_out"]))
    body.node.insert(0, helper.make_node("ReduceSum", ["y_in"], ["s"], keepdims=0))
    body.initializer.append(numpy_helper.from_array(np.float32(0), "zero"))
    runtime_cond_with_scan = make_model(
        [helper.make_node("Loop", ["M", "", "y0"], ["y", "ys"], name="lp", body=body)],
        {"y0": y0, "a": y0},
        ["y", "ys"],
        initializers={"M": np.array(3, np.int64)},
    )
    with pytest.raises(ember.UnsupportedOpError, match=r"(?s)Loop.*lp.*scan outputs"):
        ember.compile_onnx(runtime_cond_with_scan)


def cumulative_sum_body() -> Any:
    """`(acc, x_t) -> (acc + x_t, acc + x_t)`."""
    return graph(
        [
            helper.make_node("Add", ["acc_in", "x_t"], ["acc_out"]),
            helper.make_node("Identity", ["acc_out"], ["out_t"]),
        ],
        "body",
        [vi("acc_in"), vi("x_t")],
        [vi("acc_out"), vi("out_t")],
    )


@pytest.mark.parametrize(
    "attrs",
    [
        {},
        {"scan_input_directions": [1]},
        {"scan_input_axes": [1], "scan_output_axes": [-1]},
        {"scan_input_axes": [-1], "scan_output_directions": [1], "scan_output_axes": [0]},
    ],
    ids=["forward", "reverse-input", "axis1", "reverse-output"],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_scan_matches_onnx_runtime(attrs, backend):
    x = randn(4, 5, 3)
    axis = attrs.get("scan_input_axes", [0])[0]
    acc0 = np.zeros(np.delete(np.array(x.shape), axis), np.float32)
    model = make_model(
        [
            helper.make_node(
                "Scan",
                ["acc0", "x"],
                ["acc", "ys"],
                body=cumulative_sum_body(),
                num_scan_inputs=1,
                **attrs,
            )
        ],
        {"acc0": acc0, "x": x},
        ["acc", "ys"],
    )
    check(
        model,
        {"acc0": acc0 + 1, "x": x},
        compiled=compile_on(model, backend),
        **tolerance(backend),
    )


def test_a_recurrent_cell_written_as_a_scan_with_weights_inside_its_body():
    """`h_t = tanh(x_t W + h_{t-1} U)` over 12 steps; W and U are initializers of the body,
    bound once as weights however many times the body unrolls."""
    hidden, feat, steps = 16, 8, 12
    w = numpy_helper.from_array(randn(feat, hidden, seed=2) * 0.3, "W")
    u = numpy_helper.from_array(randn(hidden, hidden, seed=3) * 0.3, "U")
    body = graph(
        [
            helper.make_node("MatMul", ["x_t", "W"], ["xw"]),
            helper.make_node("MatMul", ["h_in", "U"], ["hu"]),
            helper.make_node("Add", ["xw", "hu"], ["pre"]),
            helper.make_node("Tanh", ["pre"], ["h_out"]),
            helper.make_node("Identity", ["h_out"], ["y_t"]),
        ],
        "cell",
        [vi("h_in"), vi("x_t")],
        [vi("h_out"), vi("y_t")],
        [w, u],
    )
    h0, xs = randn(2, hidden, seed=4), randn(steps, 2, feat, seed=5)
    model = make_model(
        [helper.make_node("Scan", ["h0", "xs"], ["h", "ys"], body=body, num_scan_inputs=1)],
        {"h0": h0, "xs": xs},
        ["h", "ys"],
    )
    check(model, {"h0": h0, "xs": xs})


def test_scan_over_a_symbolic_length_is_refused():
    x = randn(4, 3)
    model = make_model(
        [
            helper.make_node(
                "Scan",
                ["acc0", "x"],
                ["acc", "ys"],
                name="sc",
                body=cumulative_sum_body(),
                num_scan_inputs=1,
            )
        ],
        {"acc0": np.zeros(3, np.float32), "x": x},
        ["acc", "ys"],
        input_shapes={"x": ["T", 3]},
    )
    with pytest.raises(ember.UnsupportedOpError, match=r"(?s)Scan.*sc.*symbolic"):
        ember.compile_onnx(model)


def test_an_unsupported_op_inside_a_body_is_reported_up_front():
    then_g = graph([helper.make_node("Unique", ["x"], ["t"])], "then", [], [vi("t")])
    else_g = graph([helper.make_node("Identity", ["x"], ["e"])], "else", [], [vi("e")])
    x = randn(3)
    model = make_model(
        [helper.make_node("If", ["c"], ["y"], name="br", then_branch=then_g, else_branch=else_g)],
        {"x": x},
        ["y"],
        initializers={"c": np.array(False)},
    )
    with pytest.raises(ember.UnsupportedOpError, match=r"Unique.*br/"):
        ember.compile_onnx(model)
    # A valid model (ONNX Runtime runs it, the branch is not taken), but Ember checks every
    # op of every subgraph before translating.
    assert ort_run(model, {"x": x})[0].shape == (3,)


class ScriptedLoopAndBranch(torch.nn.Module):
    """A recurrence over the rows of `x` and a data-dependent branch: TorchScript keeps both
    as control flow, and its ONNX exporter writes them as Loop and If."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros_like(x[0])
        for i in range(x.shape[0]):
            h = torch.tanh(self.lin(x[i]) + h)
        if x.sum() > 0:
            h = h * 2
        else:
            h = h - 1
        return h


def test_torchscript_control_flow_exported_to_onnx_matches_eager():
    torch.manual_seed(0)
    scripted = torch.jit.script(ScriptedLoopAndBranch().eval())
    x = torch.randn(5, 8)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(scripted, (x,), buffer, dynamo=False, opset_version=17, input_names=["x"])
    model = onnx.load_from_string(buffer.getvalue())
    assert {"Loop", "If"} <= {n.op_type for n in model.graph.node}
    compiled = ember.compile_onnx(model)
    for sign in (1.0, -1.0):
        feed = x.abs() * sign
        with torch.no_grad():
            want = scripted(feed).numpy()
        np.testing.assert_allclose(compiled(x=feed.numpy())[0], want, rtol=1e-5, atol=1e-6)
