"""LSTM, GRU and RNN layers (unrolled over a sequence length known at compile time): torch's
recurrent modules as its exporter writes them, checked against eager and ONNX Runtime, and
hand-built nodes for what torch does not write (peepholes, clip, reverse, GRU's reset form,
other activations), checked against ONNX Runtime."""

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
from onnx_util import (
    BACKEND_NAMES,
    check,
    compile_on,
    make_model,
    ort_run,
    randn,
    tolerance,
    with_backend,
)

TOL = {"rtol": 1e-5, "atol": 1e-5}


class _Wrap(torch.nn.Module):
    """The module's outputs flattened (output, then the final states)."""

    def __init__(self, rnn: torch.nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out, last = self.rnn(x, state if len(state) > 1 else (state[0] if state else None))
        return (out, *(last if isinstance(last, tuple) else (last,)))


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize(
    ("layers", "bidirectional", "batch_first", "with_state", "backend"),
    [(1, False, True, False, "cpu"), (2, True, False, True, "cpu"), (2, False, True, True, "cpu")]
    + [with_backend((1, True, True, True), b) for b in BACKEND_NAMES[1:]],
)
def test_torch_recurrent_modules(
    tmp_path,
    kind: str,
    layers: int,
    bidirectional: bool,
    batch_first: bool,
    with_state: bool,
    backend: str,
) -> None:
    torch.manual_seed(0)
    rnn = getattr(torch.nn, kind)(
        8, 12, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first
    )
    model = _Wrap(rnn).eval()
    b, t = 3, 6
    x = torch.randn((b, t, 8) if batch_first else (t, b, 8))
    state_shape = (layers * (2 if bidirectional else 1), b, 12)
    states = (torch.randn(state_shape),) * (2 if kind == "LSTM" else 1) if with_state else ()
    names = ["x", "h0", "c0"][: 1 + len(states)]
    path = tmp_path / "rnn.onnx"
    torch.onnx.export(model, (x, *states), str(path), dynamo=True, input_names=names)
    written = onnx.load(str(path))
    # torch writes LSTM and GRU as the ONNX ops (RNN as its steps).
    assert kind == "RNN" or kind in {n.op_type for n in written.graph.node}
    feeds = {n: v.numpy() for n, v in zip(names, (x, *states), strict=True)}
    got = check(written, feeds, compiled=compile_on(str(path), backend), **TOL)
    with torch.no_grad():
        want = model(x, *states)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w.numpy(), **tolerance(backend, **TOL))


def _node_model(
    op: str, gates: int, attrs: dict[str, Any], *, dirs: int = 1, peepholes: bool = False
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    t, b, i, h = 5, 2, 4, 6
    layout = attrs.get("layout", 0)
    x = randn(*((b, t, i) if layout else (t, b, i)), seed=1)
    inits = {
        "w": randn(dirs, gates * h, i, seed=2) * 0.5,
        "r": randn(dirs, gates * h, h, seed=3) * 0.5,
        "b": randn(dirs, 2 * gates * h, seed=4) * 0.5,
    }
    state = (b, dirs, h) if layout else (dirs, b, h)
    feeds = {"x": x, "h0": randn(*state, seed=5)}
    names = ["x", "w", "r", "b", "", "h0"]
    outs = ["y", "yh"]
    if op == "LSTM":
        feeds["c0"] = randn(*state, seed=6)
        names.append("c0")
        outs.append("yc")
        if peepholes:
            inits["p"] = randn(dirs, 3 * h, seed=7) * 0.5
            names.append("p")
    node = helper.make_node(op, names, outs, hidden_size=h, **attrs)
    model = make_model([node], feeds, outs, inits)
    return model, feeds


HAND_BUILT = {
    "lstm peepholes clip": ("LSTM", 4, {"clip": 0.8}, 1, True),
    "lstm reverse layout1": ("LSTM", 4, {"direction": "reverse", "layout": 1}, 1, False),
    "lstm bidirectional peepholes": ("LSTM", 4, {"direction": "bidirectional"}, 2, True),
    "gru reset after": ("GRU", 3, {"linear_before_reset": 0}, 1, False),
    "gru linear before reset": ("GRU", 3, {"linear_before_reset": 1}, 1, False),
    "gru bidirectional layout1": ("GRU", 3, {"direction": "bidirectional", "layout": 1}, 2, False),
    "rnn relu": ("RNN", 1, {"activations": ["Relu"]}, 1, False),
    "rnn bidirectional clip": (
        "RNN",
        1,
        {"direction": "bidirectional", "clip": 0.5, "activations": ["Tanh", "Sigmoid"]},
        2,
        False,
    ),
}


@pytest.mark.parametrize("case", list(HAND_BUILT))
def test_recurrent_nodes(case: str) -> None:
    op, gates, attrs, dirs, peepholes = HAND_BUILT[case]
    model, feeds = _node_model(op, gates, attrs, dirs=dirs, peepholes=peepholes)
    if attrs.get("layout", 0) == 0:
        check(model, feeds, **TOL)
        return
    # ONNX Runtime has no batch-first recurrent kernels: it runs the same node in layout 0
    # on transposed inputs, its outputs transposed back.
    seq_first = {**attrs, "layout": 0}
    model0, _ = _node_model(op, gates, seq_first, dirs=dirs, peepholes=peepholes)
    feeds0 = {"x": feeds["x"].transpose(1, 0, 2)}
    feeds0 |= {k: v.transpose(1, 0, 2) for k, v in feeds.items() if k != "x"}
    want = ort_run(model0, {k: np.ascontiguousarray(v) for k, v in feeds0.items()})
    want = [want[0].transpose(2, 0, 1, 3)] + [w.transpose(1, 0, 2) for w in want[1:]]
    got = ember.compile_onnx(model)(**feeds)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, **TOL)


def test_a_sequence_length_unknown_at_compile_time_is_refused() -> None:
    model, _ = _node_model("GRU", 3, {})
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "steps"
    with pytest.raises(ember.UnsupportedOpError, match="unknown at compile time"):
        ember.compile_onnx(model)


@pytest.mark.parametrize(
    "op, gates, direction",
    [
        ("LSTM", 4, "forward"),
        ("LSTM", 4, "bidirectional"),
        ("GRU", 3, "reverse"),
        ("RNN", 1, "bidirectional"),
    ],
)
def test_sequence_lens_masks_steps_past_each_sequence(op: str, gates: int, direction: str) -> None:
    """Padded batches: a sequence keeps its states past its length and its outputs there are
    zeros; the reverse direction starts at each sequence's own last step."""
    t, b, i, h = 5, 3, 4, 6
    dirs = 2 if direction == "bidirectional" else 1
    inits = {
        "w": randn(dirs, gates * h, i, seed=2) * 0.5,
        "r": randn(dirs, gates * h, h, seed=3) * 0.5,
        "b": randn(dirs, 2 * gates * h, seed=4) * 0.5,
    }
    feeds = {"x": randn(t, b, i, seed=1), "lens": np.array([5, 3, 1], np.int32)}
    feeds["h0"] = randn(dirs, b, h, seed=5)
    names, outs = ["x", "w", "r", "b", "lens", "h0"], ["y", "yh"]
    if op == "LSTM":
        feeds["c0"] = randn(dirs, b, h, seed=6)
        names.append("c0")
        outs.append("yc")
    node = helper.make_node(op, names, outs, hidden_size=h, direction=direction)
    model = make_model([node], feeds, outs, inits)
    assert model.graph.input[1].type.tensor_type.elem_type == TensorProto.INT32
    compiled = ember.compile_onnx(model)
    check(model, feeds, compiled=compiled, **TOL)
    # One compiled model serves other lengths: they are values, not shapes.
    check(model, {**feeds, "lens": np.array([2, 5, 4], np.int32)}, compiled=compiled, **TOL)


class _Packed(torch.nn.Module):
    """A bidirectional LSTM over a padded batch, packed by length (unsorted lengths)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.LSTM(4, 6, bidirectional=True)

    def forward(self, x: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, lens, enforce_sorted=False)
        y, (h, c) = self.rnn(packed)
        y, _ = torch.nn.utils.rnn.pad_packed_sequence(y, total_length=x.shape[0])
        return y, h, c


def test_a_packed_sequence_exported_by_torch_matches_eager() -> None:
    """TorchScript's exporter writes `pack_padded_sequence` as the LSTM's sequence_lens."""
    torch.manual_seed(0)
    model = _Packed().eval()
    x, lens = torch.randn(5, 3, 4), torch.tensor([5, 3, 1])
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x, lens), buffer, dynamo=False, input_names=["x", "lens"])
    written = onnx.load_from_string(buffer.getvalue())
    assert "LSTM" in {n.op_type for n in written.graph.node}
    compiled = ember.compile_onnx(written)
    for lengths in ([5, 3, 1], [2, 5, 4]):
        lens = torch.tensor(lengths)
        got = compiled(x=x.numpy(), lens=lens.numpy())
        with torch.no_grad():
            want = model(x, lens)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w.numpy(), **TOL)
