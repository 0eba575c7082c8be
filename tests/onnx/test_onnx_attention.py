"""Attention as exporters write it (MatMul → scale → Add mask → Softmax → MatMul) runs as
one fused attention op, with the results of the decomposed graph (checked against ONNX
Runtime); chains whose intermediates are used elsewhere stay decomposed."""

from __future__ import annotations

import ember
import numpy as np
import onnx
import pytest
import torch
from onnx import helper
from onnx_util import BACKENDS, check, compile_on, export_bert, make_model, randn


def _attention_model(
    form: str, with_mask: bool, softmax_out: bool = False, nan_guard: bool = False
):
    """q [2, 3, 5, 8], k [2, 3, 7, 8], v [2, 3, 7, 4]; the scale applied as `form` says;
    `nan_guard`: the weights pass through `Where(IsNaN(w), 0, w)` as torch's exporter
    writes them, and query row 1 sees no key (its softmax is NaN, its output zeros)."""
    q, k, v = randn(2, 3, 5, 8, seed=1) * 2, randn(2, 3, 7, 8, seed=2), randn(2, 3, 7, 4, seed=3)
    feeds = {"q": q, "k": k, "v": v}
    inits = {}
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2])]
    if form == "both":  # torch's exporter: q and kᵀ each times √scale
        inits["c"] = np.array([8**-0.25], dtype=np.float32)
        nodes += [
            helper.make_node("Mul", ["q", "c"], ["qs"]),
            helper.make_node("Mul", ["c", "kt"], ["ks"]),
            helper.make_node("MatMul", ["qs", "ks"], ["scores"]),
        ]
    else:  # the scores divided by √d after the product
        inits["d"] = np.array(np.sqrt(8.0), dtype=np.float32)
        nodes += [
            helper.make_node("MatMul", ["q", "kt"], ["raw"]),
            helper.make_node("Div", ["raw", "d"], ["scores"]),
        ]
    if with_mask:
        bias = np.where(np.random.rand(5, 7) > 0.3, 0.0, -np.inf).astype(np.float32)
        bias[:, 0] = 0.0
        if nan_guard:
            bias[1, :] = -np.inf
        inits["bias"] = bias
        nodes.append(helper.make_node("Add", ["bias", "scores"], ["masked"]))
    else:
        nodes.append(helper.make_node("Identity", ["scores"], ["masked"]))
    nodes.append(helper.make_node("Softmax", ["masked"], ["weights"], axis=-1))
    if nan_guard:
        inits["zero"] = np.array(0.0, dtype=np.float32)
        nodes += [
            helper.make_node("IsNaN", ["weights"], ["nan"]),
            helper.make_node("Where", ["nan", "zero", "weights"], ["guarded"]),
            helper.make_node("MatMul", ["guarded", "v"], ["out"]),
        ]
    else:
        nodes.append(helper.make_node("MatMul", ["weights", "v"], ["out"]))
    outputs = ["out", "weights"] if softmax_out else ["out"]
    return make_model(nodes, feeds, outputs, initializers=inits), feeds


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["both", "after"])
@pytest.mark.parametrize("with_mask", [False, True])
def test_decomposed_attention_runs_fused(form: str, with_mask: bool, backend: str) -> None:
    model, feeds = _attention_model(form, with_mask)
    compiled = compile_on(model, backend)
    check(model, feeds, rtol=1e-5, atol=1e-5, compiled=compiled)
    ir = compiled.ir()
    assert "attention(" in ir and "softmax(" not in ir, ir


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_guarded_weights_run_fused_and_a_row_seeing_no_key_gives_zeros(backend) -> None:
    model, feeds = _attention_model("both", True, nan_guard=True)
    compiled = compile_on(model, backend)
    got = check(model, feeds, rtol=1e-5, atol=1e-5, compiled=compiled)
    assert not np.isnan(got[0]).any() and (got[0][:, :, 1] == 0).all()
    ir = compiled.ir()
    assert "attention(" in ir and "isnan(" not in ir, ir


def test_attention_weights_used_elsewhere_stay_decomposed() -> None:
    model, feeds = _attention_model("both", True, softmax_out=True)
    compiled = ember.compile_onnx(model)
    check(model, feeds, rtol=1e-5, atol=1e-5, compiled=compiled)
    assert "attention(" not in compiled.ir()


def test_eager_attention_traced_from_torch_runs_fused() -> None:
    """A module that writes attention out (as "eager" attention implementations do), traced
    by torch.export: the same fusion on the PT2 path, checked against eager."""

    class Eager(torch.nn.Module):
        def forward(self, q, k, v, bias):
            w = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5 + bias, dim=-1)
            return w @ v

    q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 4, 11, 8), torch.randn(2, 4, 11, 6)
    bias = torch.zeros(9, 11).masked_fill(torch.rand(9, 11) > 0.7, float("-inf"))
    bias[:, 0] = 0.0
    model = Eager().eval()
    compiled = ember.compile(model, q, k, v, bias)
    torch.testing.assert_close(compiled(q, k, v, bias), model(q, k, v, bias), rtol=1e-5, atol=1e-5)
    assert "attention(" in compiled.ir()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("masked", [-np.inf, np.finfo(np.float32).min])
def test_constant_causal_mask_becomes_causal_attention(masked: float, backend: str) -> None:
    """The causal mask an exporter captures as a constant (-inf, or the dtype's lowest as
    Hugging Face writes it) runs as causal attention, which skips the masked keys."""
    q, k, v = randn(1, 2, 6, 8, seed=1), randn(1, 2, 6, 8, seed=2), randn(1, 2, 6, 5, seed=3)
    bias = np.triu(np.full((6, 6), masked, dtype=np.float32), k=1)
    not_causal = bias.copy()
    not_causal[4, 2] = masked  # one more key hidden: a mask like any other
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["raw"]),
        helper.make_node("Mul", ["raw", "c"], ["scores"]),
        helper.make_node("Add", ["scores", "bias"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["weights"], axis=-1),
        helper.make_node("MatMul", ["weights", "v"], ["out"]),
    ]
    feeds = {"q": q, "k": k, "v": v}
    for mask, causal in [(bias, True), (not_causal, False)]:
        inits = {"c": np.array(0.3, dtype=np.float32), "bias": mask}
        model = make_model(nodes, feeds, ["out"], initializers=inits)
        compiled = compile_on(model, backend)
        check(model, feeds, rtol=1e-5, atol=1e-5, compiled=compiled)
        assert f"causal={str(causal).lower()}" in compiled.ir(), compiled.ir()


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_query_keys_transposed_after_the_repeat(backend: str) -> None:
    """torch's exporter repeats grouped-query KV heads (Unsqueeze, Expand, Reshape) and then
    transposes the keys through batch-regrouping reshapes: the attention reads the repeat
    itself (the optimizer then keeps the broadcast a view)."""
    q, k, v = randn(1, 4, 5, 8, seed=7), randn(1, 2, 7, 8, seed=8), randn(1, 2, 7, 3, seed=9)
    i64 = lambda *xs: np.array(xs, dtype=np.int64)  # noqa: E731
    inits = {
        "ax": i64(2),
        "wide": i64(1, 2, 2, 7, 8),
        "wide_v": i64(1, 2, 2, 7, 3),
        "flat": i64(4, 7, 8),
        "heads_kt": i64(1, 4, 8, 7),
        "heads_v": i64(1, 4, 7, 3),
        "c": np.array(8**-0.25, dtype=np.float32),
    }
    nodes = [
        helper.make_node("Unsqueeze", ["k", "ax"], ["k5"]),
        helper.make_node("Expand", ["k5", "wide"], ["kw"]),
        helper.make_node("Reshape", ["kw", "flat"], ["kf"]),
        helper.make_node("Transpose", ["kf"], ["kft"], perm=[0, 2, 1]),
        helper.make_node("Reshape", ["kft", "heads_kt"], ["kt"]),
        helper.make_node("Unsqueeze", ["v", "ax"], ["v5"]),
        helper.make_node("Expand", ["v5", "wide_v"], ["vw"]),
        helper.make_node("Reshape", ["vw", "heads_v"], ["vr"]),
        helper.make_node("Mul", ["q", "c"], ["qs"]),
        helper.make_node("Mul", ["kt", "c"], ["ks"]),
        helper.make_node("MatMul", ["qs", "ks"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["weights"], axis=-1),
        helper.make_node("MatMul", ["weights", "vr"], ["out"]),
    ]
    feeds = {"q": q, "k": k, "v": v}
    model = make_model(nodes, feeds, ["out"], initializers=inits)
    for iterations in (0, 4):
        compiled = compile_on(model, backend, search_iterations=iterations)
        check(model, feeds, rtol=1e-5, atol=1e-5, compiled=compiled)
        assert "attention(" in compiled.ir() and "permute(" not in compiled.ir()


def test_torch_mask_buffer_updated_in_place_is_followed() -> None:
    """A causal mask held in a module buffer is a weight the caller may change in place
    after compiling: the fused attention must keep reading it, not fix it as causal."""

    class Masked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            causal = torch.full((6, 6), float("-inf")).triu(1)
            self.register_buffer("bias", causal)

        def forward(self, q, k, v):
            w = torch.softmax(q @ k.transpose(-1, -2) * 0.3 + self.bias, dim=-1)
            return w @ v

    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 5)
    model = Masked().eval()
    compiled = ember.compile(model, q, k, v)
    assert "attention(" in compiled.ir()
    torch.testing.assert_close(compiled(q, k, v), model(q, k, v), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        model.bias[4, 2] = float("-inf")  # one more key hidden: no longer causal
    torch.testing.assert_close(compiled(q, k, v), model(q, k, v), rtol=1e-5, atol=1e-5)


def test_bert_eager_attention_with_dynamic_axes_runs_fused(tmp_path) -> None:
    """Hugging Face BERT with eager attention, exported with dynamic batch and length: its
    positions are `min(s, max_positions)` wide and its mask `s`, so the scores reach the
    mask through an `expand` of the key axis. The attention is still recovered; a length
    past the position table is refused, never computed on mismatched shapes."""
    path = tmp_path / "bert.onnx"
    export_bert(
        path,
        attn_implementation="eager",
        hidden_size=32,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=16,
    )
    model = onnx.load(str(path))
    compiled = ember.compile_onnx(model)
    ir = compiled.ir()
    assert ir.count("attention(") == 2 and "softmax(" not in ir, ir
    for batch, seq in ((2, 7), (1, 16), (3, 1)):
        mask = np.ones((batch, seq), np.int64)
        mask[0, seq // 2 :] = 0
        mask[0, 0] = 1
        ids = np.random.default_rng(seq).integers(0, 100, (batch, seq))
        check(model, {"ids": ids, "mask": mask}, rtol=1e-5, atol=1e-5, compiled=compiled)
    too_long = {"ids": np.zeros((1, 20), np.int64), "mask": np.ones((1, 20), np.int64)}
    with pytest.raises((ember.ShapeError, ember.InputError)):
        compiled(**too_long)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("swapped", [True, False])
def test_rotate_half_becomes_a_flip_of_halves(swapped: bool, backend: str) -> None:
    """Rotary embeddings as exporters write them, `x·cos + concat(−x₂, x₁)·sin`: the
    concat of the negated upper half and the lower half runs as one elementwise op over a
    flip of the halves (no concat left); the halves concatenated the other way round, which
    is no rotation, stay a concat. Both match ONNX Runtime, optimized or as translated."""
    x, cos, sin = randn(2, 3, 4, 16, seed=4), randn(4, 16, seed=5), randn(4, 16, seed=6)
    first, second = ("hi", "lo") if swapped else ("lo", "hi")
    nodes = [
        helper.make_node("Slice", ["x", "zero", "half", "last"], ["lo"]),
        helper.make_node("Slice", ["x", "half", "whole", "last"], ["hi"]),
        helper.make_node("Neg", [first], ["neg"]),
        helper.make_node("Concat", ["neg", second], ["rot"], axis=-1),
        helper.make_node("Mul", ["x", "cos"], ["xc"]),
        helper.make_node("Mul", ["rot", "sin"], ["rs"]),
        helper.make_node("Add", ["xc", "rs"], ["y"]),
    ]
    consts = {
        name: np.array([v], dtype=np.int64)
        for name, v in [("zero", 0), ("half", 8), ("whole", 16), ("last", -1)]
    }
    feeds = {"x": x, "cos": cos, "sin": sin}
    model = make_model(nodes, feeds, ["y"], initializers=consts)
    compiled = compile_on(model, backend)
    check(model, feeds, compiled=compiled)
    assert ("concat" in compiled.ir()) != swapped, compiled.ir()
    # As translated (no optimizer): the replaced negation is not left behind to run.
    translated = compile_on(model, backend, search_iterations=0)
    check(model, feeds, compiled=translated)
    assert ("neg" in translated.ir()) != swapped, translated.ir()
