"""ONNX Runtime's fused `com.microsoft` transformer ops — Attention, MultiHeadAttention,
GroupQueryAttention, RotaryEmbedding, EmbedLayerNormalization and MatMulNBits — against
ONNX Runtime itself, and a BERT whose attention and embeddings ONNX Runtime's optimizer
fused."""

from __future__ import annotations

from typing import Any

import ember
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_util import (
    BACKENDS,
    check,
    compile_on,
    export_bert,
    int8_weights,
    ort_run,
    randn,
    tolerance,
)

MS = "com.microsoft"
TOL = {"rtol": 1e-5, "atol": 2e-5}


def ms_model(
    op: str,
    inputs: dict[str, np.ndarray | None],
    outputs: dict[str, int],
    consts: dict[str, np.ndarray] | None = None,
    shapes: dict[str, list[Any]] | None = None,
    **attrs: Any,
) -> onnx.ModelProto:
    """One `op` node; `inputs` in order (None: an absent optional input), those named in
    `consts` as initializers, the rest graph inputs (`shapes` may make their dims
    symbolic); `outputs` name → element type ("" skips one)."""
    consts = consts or {}
    shapes = shapes or {}
    names = [k if v is not None or k in consts else "" for k, v in inputs.items()]
    node = helper.make_node(op, names, list(outputs), domain=MS, name="fused", **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info(
                k, helper.np_dtype_to_tensor_dtype(v.dtype), shapes.get(k, list(v.shape))
            )
            for k, v in inputs.items()
            if v is not None and k not in consts
        ],
        [helper.make_tensor_value_info(o, t, None) for o, t in outputs.items() if o],
        [numpy_helper.from_array(v, k) for k, v in consts.items()],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


def feeds_of(inputs: dict[str, np.ndarray | None], consts: dict[str, Any] | None = None):
    return {k: v for k, v in inputs.items() if v is not None and k not in (consts or {})}


F = TensorProto.FLOAT
B, S, N, H = 2, 5, 4, 8
D = N * H


def attention_inputs(past: int = 0, s: int = S, **extra: np.ndarray | None):
    inputs: dict[str, np.ndarray | None] = {
        "x": randn(B, s, D),
        "w": randn(D, 3 * D, seed=1) * 0.3,
        "bias": randn(3 * D, seed=2),
        "mask_index": None,
        "past": randn(2, B, N, past, H, seed=3) if past else None,
        "attention_bias": None,
    }
    inputs.update(extra)
    return inputs


T = S  # keys without a past
ATTENTION_CASES = {
    "plain": ({}, {}),
    "ends [B]": ({"mask_index": np.array([3, 5], np.int32)}, {}),
    "ends and starts [2B]": ({"mask_index": np.array([4, 5, 1, 2], np.int32)}, {}),
    "[3B+2]": ({"mask_index": np.array([2, 4, 0, 0, 0, 0, 0, 0], np.int32)}, {}),
    "raw [B, T]": ({"mask_index": np.array([[1, 1, 0, 1, 0], [1, 1, 1, 1, 1]], np.int32)}, {}),
    "raw [B, S, T]": (
        {"mask_index": np.random.default_rng(4).integers(0, 2, (B, S, T)).astype(np.int32)},
        {},
    ),
    "causal": ({}, {"unidirectional": 1}),
    "causal over padding": (
        {"mask_index": np.array([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]], np.int32)},
        {"unidirectional": 1},
    ),
    "attention bias": ({"attention_bias": randn(1, N, S, T, seed=5)}, {}),
    "bias per batch, padding, scale": (
        {"attention_bias": randn(B, 1, S, T, seed=5), "mask_index": np.array([4, 2], np.int32)},
        {"scale": 0.25, "mask_filter_value": -50.0},
    ),
    "no bias": ({"bias": None}, {}),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_matches_onnx_runtime(case: str, backend: str) -> None:
    extra, attrs = ATTENTION_CASES[case]
    inputs = attention_inputs(**extra)
    model = ms_model("Attention", inputs, {"y": F}, num_heads=N, **attrs)
    check(model, feeds_of(inputs), compiled=compile_on(model, backend), **tolerance(backend, **TOL))


@pytest.mark.parametrize("s", [1, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_with_a_past_gives_the_present(s: int, backend: str) -> None:
    """GPT-2's fused attention: a past `[2, B, N, P, H]`, causal over past and new keys,
    padding over both."""
    inputs = attention_inputs(
        past=4, s=s, mask_index=np.array([[1] * (4 + s), [0, 1] + [1] * (2 + s)], np.int32)
    )
    model = ms_model("Attention", inputs, {"y": F, "present": F}, num_heads=N, unidirectional=1)
    check(model, feeds_of(inputs), compiled=compile_on(model, backend), **tolerance(backend, **TOL))


def test_attention_with_unequal_value_width() -> None:
    inputs = attention_inputs(w=randn(D, 2 * D + 2 * N, seed=1), bias=randn(2 * D + 2 * N))
    model = ms_model("Attention", inputs, {"y": F}, num_heads=N, qkv_hidden_sizes=[D, D, 2 * N])
    check(model, feeds_of(inputs), **TOL)


def test_attention_is_translated_once_for_any_batch_and_length() -> None:
    inputs = attention_inputs(mask_index=np.array([3, 5], np.int32))
    shapes = {"x": ["b", "s", D], "mask_index": ["b"]}
    consts = {"w": inputs["w"], "bias": inputs["bias"]}
    model = ms_model("Attention", inputs, {"y": F}, consts, shapes, num_heads=N, unidirectional=1)
    compiled = ember.compile_onnx(model)
    for b, s in ((2, 5), (3, 2), (1, 7)):
        feeds = {
            "x": randn(b, s, D, seed=s),
            "mask_index": np.arange(1, b + 1, dtype=np.int32) + s // 2,
        }
        check(model, feeds, compiled=compiled, **TOL)


def test_refusals_name_the_node_and_the_reason() -> None:
    inputs = attention_inputs()
    model = ms_model("Attention", inputs, {"y": F}, num_heads=N, do_rotary=1)
    with pytest.raises(ember.UnsupportedOpError, match="Attention.*fused.*do_rotary"):
        ember.compile_onnx(model)
    inputs = attention_inputs(mask_index=np.ones((B, 1, S, S), np.int32))
    model = ms_model("Attention", inputs, {"y": F}, num_heads=N)
    with pytest.raises(ember.UnsupportedOpError, match="fused.*mask of rank 4"):
        ember.compile_onnx(model)
    inputs = attention_inputs(mask_index=np.array([1, 2, 3], np.int32))
    model = ms_model("Attention", inputs, {"y": F}, num_heads=N)
    with pytest.raises(ember.CompileError, match="fused.*1-d mask of 3 elements"):
        ember.compile_onnx(model)


def mha_inputs(keys: int = S, past: int = 0, **extra: np.ndarray | None):
    inputs: dict[str, np.ndarray | None] = {
        "q": randn(B, S, D),
        "k": randn(B, keys, D, seed=1),
        "v": randn(B, keys, D, seed=2),
        "bias": randn(3 * D, seed=3),
        "key_padding_mask": None,
        "attention_bias": None,
        "past_key": randn(B, N, past, H, seed=4) if past else None,
        "past_value": randn(B, N, past, H, seed=5) if past else None,
    }
    inputs.update(extra)
    return inputs


MHA_CASES = {
    "self": (mha_inputs(), {}),
    "cross, longer keys, padding [B]": (
        mha_inputs(keys=7, key_padding_mask=np.array([7, 3], np.int32)),
        {},
    ),
    "padding [B, T], attention bias": (
        mha_inputs(
            key_padding_mask=np.array([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1]], np.int32),
            attention_bias=randn(1, N, S, S, seed=6),
        ),
        {},
    ),
    "keys split into heads": (
        mha_inputs(k=randn(B, N, 6, H, seed=1), v=randn(B, N, 6, H, seed=2)),
        {},
    ),
    "causal with a past": (mha_inputs(past=3), {"unidirectional": 1}),
    "causal cross attention": (mha_inputs(keys=7), {"unidirectional": 1}),
    "no bias, scale": (mha_inputs(bias=None), {"scale": 0.5}),
}


@pytest.mark.parametrize("case", list(MHA_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_multi_head_attention_matches_onnx_runtime(case: str, backend: str) -> None:
    inputs, attrs = MHA_CASES[case]
    model = ms_model(
        "MultiHeadAttention",
        inputs,
        {"y": F, "present_key": F, "present_value": F},
        num_heads=N,
        **attrs,
    )
    check(model, feeds_of(inputs), compiled=compile_on(model, backend), **tolerance(backend, **TOL))


KV, HG = 2, 16  # key/value heads and head size of the grouped-query cases


def rotary_tables(positions: int, rot: int) -> tuple[np.ndarray, np.ndarray]:
    angles = np.outer(np.arange(positions), 1.0 / 10000 ** (np.arange(0, rot, 2) / rot))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def gqa_inputs(
    s: int, past: int, seqlens: list[int], total: int, packed: bool = False, rot: int = 0
) -> tuple[dict[str, np.ndarray | None], dict[str, np.ndarray]]:
    b = len(seqlens)
    q = randn(b, s, (N + 2 * KV) * HG if packed else N * HG)
    cos, sin = rotary_tables(64, rot) if rot else (None, None)
    inputs: dict[str, np.ndarray | None] = {
        "q": q,
        "k": None if packed else randn(b, s, KV * HG, seed=1),
        "v": None if packed else randn(b, s, KV * HG, seed=2),
        "past_key": randn(b, KV, past, HG, seed=3) if past else None,
        "past_value": randn(b, KV, past, HG, seed=4) if past else None,
        "seqlens_k": np.array(seqlens, np.int32) - 1,
        "total_sequence_length": np.array(total, np.int32),
        "cos_cache": cos,
        "sin_cache": sin,
    }
    consts = {"total_sequence_length": inputs["total_sequence_length"]}
    if rot:
        consts.update(cos_cache=cos, sin_cache=sin)
    return inputs, consts


def gqa_model(inputs: dict[str, np.ndarray | None], consts: dict, **attrs: Any) -> Any:
    """One GroupQueryAttention node with the tests' head counts and all three outputs."""
    outputs = {"y": F, "present_key": F, "present_value": F}
    return ms_model(
        "GroupQueryAttention", inputs, outputs, consts=consts, num_heads=N, kv_num_heads=KV, **attrs
    )


def assert_gqa_close(got: list, want: list, s: int, lens: list[int], total: int, tol) -> None:
    """Output and caches compared. Padded queries of a first prompt (rows past the
    sequence's length) are unspecified in ONNX Runtime's kernels; every other row is."""
    for b, tot in enumerate(lens):
        rows = min(s, tot) if s == total else s
        np.testing.assert_allclose(got[0][b, :rows], want[0][b, :rows], **tol)
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, **tol)


GQA_CASES = {
    # (s, past buffer, total keys per sequence, total_sequence_length, attributes)
    "first prompt": (6, 0, [6, 6], 6, {}),
    "first prompt, right padding, rotary": (6, 0, [6, 4], 6, {"do_rotary": 1}),
    "decode": (1, 5, [6, 6], 6, {"do_rotary": 1}),
    "decode, shorter sequence": (1, 5, [6, 3], 6, {}),
    "decode into a static cache": (1, 9, [6, 4], 6, {"do_rotary": 1, "rotary_interleaved": 1}),
    "a second prompt chunk": (3, 4, [7], 7, {"do_rotary": 1}),
    "packed, local window": (6, 0, [6, 6], 6, {"packed": True, "local_window_size": 3}),
    "soft cap, scale": (1, 5, [6, 5], 6, {"softcap": 2.0, "scale": 0.3}),
    "not causal": (4, 0, [4, 3], 4, {"causal": 0}),
}


@pytest.mark.parametrize("case", list(GQA_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_group_query_attention_matches_onnx_runtime(case: str, backend: str) -> None:
    s, past, lens, total, attrs = GQA_CASES[case]
    attrs = dict(attrs)
    packed = attrs.pop("packed", False)
    inputs, consts = gqa_inputs(
        s, past, lens, total, packed, rot=HG if attrs.get("do_rotary") else 0
    )
    model = gqa_model(inputs, consts, **attrs)
    feeds = feeds_of(inputs, consts)
    want = ort_run(model, feeds)
    got = compile_on(model, backend)(**feeds)
    assert_gqa_close(got, want, s, lens, total, tolerance(backend, **TOL))


@pytest.mark.parametrize("s, past, lens", [(6, 0, [6, 6]), (1, 5, [6, 4])])
@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_group_query_attention_rotates_at_given_positions(
    s: int, past: int, lens: list[int], symbolic: bool, backend: str
) -> None:
    """`position_ids`: per query in decode; on a first prompt ONNX Runtime counts every
    sequence from the first element. With a symbolic length the choice is made per call."""
    inputs, consts = gqa_inputs(s, past, lens, 6, rot=HG)
    inputs["position_ids"] = np.random.default_rng(5).integers(0, 40, (len(lens), s))
    shapes = {}
    if symbolic:
        b = len(lens)
        shapes = {"q": [b, "s", N * HG], "k": [b, "s", KV * HG], "v": [b, "s", KV * HG]}
        shapes["position_ids"] = [b, "s"]
    model = ms_model(
        "GroupQueryAttention",
        inputs,
        {"y": F, "present_key": F, "present_value": F},
        consts=consts,
        shapes=shapes,
        num_heads=N,
        kv_num_heads=KV,
        do_rotary=1,
    )
    check(
        model,
        feeds_of(inputs, consts),
        compiled=compile_on(model, backend),
        **tolerance(backend, **TOL),
    )


GQA_EXTRA_CASES = {
    # (s, past buffer, total keys per sequence, total_sequence_length, attributes); "sink":
    # a head_sink input, "bias": an attention_bias, "norm": q/k norm weights, "rotary".
    "decode, head_sink": (1, 5, [6, 4], 6, {"sink": True}),
    "prompt, right padding, head_sink": (6, 0, [6, 3], 6, {"sink": True}),
    "decode, smooth_softmax": (1, 5, [6, 6], 6, {"smooth_softmax": 1}),
    "head_sink over smooth_softmax, bias, soft cap": (
        1,
        5,
        [6, 5],
        6,
        {"sink": True, "smooth_softmax": 1, "bias": True, "softcap": 3.0},
    ),
    "decode, q/k norms, rotary": (1, 5, [6, 4], 6, {"norm": True, "rotary": True}),
    "prompt, q/k norms with their own epsilons": (
        4,
        0,
        [4, 4],
        4,
        {"norm": True, "qk_norm_epsilon": 0.5, "k_norm_epsilon": 1e-3},
    ),
}


@pytest.mark.parametrize("case", list(GQA_EXTRA_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_group_query_attention_with_sinks_and_norms(case: str, backend: str) -> None:
    """A sink logit per head in every softmax's denominator (`head_sink`, gpt-oss), or a
    zero one (`smooth_softmax`); Qwen3's per-head RMS norms of queries and keys."""
    s, past, lens, total, attrs = GQA_EXTRA_CASES[case]
    attrs = dict(attrs)
    sink, bias = attrs.pop("sink", False), attrs.pop("bias", False)
    norm, rotary = attrs.pop("norm", False), attrs.pop("rotary", False)
    inputs, consts = gqa_inputs(s, past, lens, total, rot=HG if rotary else 0)
    rng = np.random.default_rng(9)
    inputs["position_ids"] = None
    width = max(total, past)
    inputs["attention_bias"] = randn(len(lens), 1, s, width, seed=8) if bias else None
    inputs["head_sink"] = rng.standard_normal(N).astype(np.float32) * 2 if sink else None
    inputs["k_scale"] = inputs["v_scale"] = None
    for name in ("q_norm_weight", "k_norm_weight"):
        inputs[name] = rng.uniform(0.5, 1.5, HG).astype(np.float32) if norm else None
    model = gqa_model(inputs, consts, do_rotary=int(rotary), **attrs)
    feeds = feeds_of(inputs, consts)
    got = compile_on(model, backend)(**feeds)
    reference = model
    if norm:
        # ONNX Runtime's CPU kernel refuses the norm weights: its reference is the same
        # model fed queries and keys normalized here (Qwen3's RMS norm of each head).
        both = attrs.get("qk_norm_epsilon", 1e-6)
        for x, w, eps in (
            ("q", "q_norm_weight", "q_norm_epsilon"),
            ("k", "k_norm_weight", "k_norm_epsilon"),
        ):
            heads = inputs[x].reshape(len(lens), s, -1, HG).astype(np.float64)
            rms = np.sqrt((heads**2).mean(-1, keepdims=True) + attrs.get(eps, both))
            inputs[x] = (heads / rms * inputs[w]).reshape(inputs[x].shape).astype(np.float32)
            inputs[w] = None
        others = {k: v for k, v in attrs.items() if not k.endswith("epsilon")}
        reference = gqa_model(inputs, consts, do_rotary=int(rotary), **others)
    want = ort_run(reference, feeds_of(inputs, consts))
    assert_gqa_close(got, want, s, lens, total, tolerance(backend, **TOL))


def test_group_query_attention_serves_prompt_and_decode_from_one_compile() -> None:
    """As ONNX Runtime's LLM builder (onnxruntime-genai) writes it: `total_sequence_length`
    is the attention mask's width, `seqlens_k` its row sums minus one, every length
    symbolic, the cache's head size too (`kv_cache_dim`)."""
    nodes = [
        helper.make_node("Shape", ["mask"], ["mask_shape"]),
        helper.make_node("Gather", ["mask_shape", "one"], ["total64"], axis=0),
        helper.make_node("Cast", ["total64"], ["total"], to=TensorProto.INT32),
        helper.make_node("ReduceSum", ["mask", "axis1"], ["lens"], keepdims=0),
        helper.make_node("Sub", ["lens", "one"], ["lens1"]),
        helper.make_node("Cast", ["lens1"], ["seqlens_k"], to=TensorProto.INT32),
        helper.make_node(
            "GroupQueryAttention",
            ["q", "k", "v", "past_key", "past_value", "seqlens_k", "total", "cos", "sin"],
            ["y", "present_key", "present_value"],
            domain=MS,
            num_heads=N,
            kv_num_heads=KV,
            do_rotary=1,
        ),
    ]
    cos, sin = rotary_tables(64, HG)
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("q", F, ["b", "s", N * HG]),
            helper.make_tensor_value_info("k", F, ["b", "s", KV * HG]),
            helper.make_tensor_value_info("v", F, ["b", "s", KV * HG]),
            helper.make_tensor_value_info("past_key", F, ["b", KV, "p", "kv_cache_dim"]),
            helper.make_tensor_value_info("past_value", F, ["b", KV, "p", "kv_cache_dim"]),
            helper.make_tensor_value_info("mask", TensorProto.INT64, ["b", "t"]),
        ],
        [helper.make_tensor_value_info(o, F, None) for o in ("y", "present_key", "present_value")],
        [
            numpy_helper.from_array(np.array(1, np.int64), "one"),
            numpy_helper.from_array(np.array([1], np.int64), "axis1"),
            numpy_helper.from_array(cos, "cos"),
            numpy_helper.from_array(sin, "sin"),
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    )
    model.ir_version = 8
    compiled = ember.compile_onnx(model)
    past_k = np.zeros((1, KV, 0, HG), np.float32)
    past_v = past_k
    length = 0
    for step, s in enumerate((5, 1, 1)):
        length += s
        feeds = {
            "q": randn(1, s, N * HG, seed=step),
            "k": randn(1, s, KV * HG, seed=step + 10),
            "v": randn(1, s, KV * HG, seed=step + 20),
            "past_key": past_k,
            "past_value": past_v,
            "mask": np.ones((1, length), np.int64),
        }
        _, past_k, past_v = check(model, feeds, compiled=compiled, **TOL)


def test_group_query_attention_needs_a_total_length_from_shapes() -> None:
    inputs, _ = gqa_inputs(1, 5, [6, 6], 6)
    model = ms_model("GroupQueryAttention", inputs, {"y": F}, num_heads=N, kv_num_heads=KV)
    with pytest.raises(ember.UnsupportedOpError, match="total_sequence_length"):
        ember.compile_onnx(model)
    # A constant total that is neither the past plus the new keys nor within the buffer.
    inputs, consts = gqa_inputs(1, 5, [6, 6], 9)
    model = ms_model(
        "GroupQueryAttention", inputs, {"y": F}, consts=consts, num_heads=N, kv_num_heads=KV
    )
    with pytest.raises(ember.CompileError, match="fused.*total_sequence_length 9"):
        ember.compile_onnx(model)


ROTARY_CASES = {
    "[B, S, hidden], positions": ({"x": randn(B, S, D)}, {}),
    "[B, N, S, H], interleaved": ({"x": randn(B, N, S, H)}, {"interleaved": 1}),
    "offset": ({"x": randn(B, S, D), "position_ids": np.array([7], np.int64)}, {}),
    "part of each head": ({"x": randn(B, S, D)}, {"num_heads": N, "rotary_embedding_dim": 4}),
}


@pytest.mark.parametrize("case", list(ROTARY_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_rotary_embedding_matches_onnx_runtime(case: str, backend: str) -> None:
    given, attrs = ROTARY_CASES[case]
    rot = attrs.get("rotary_embedding_dim", H)
    cos, sin = rotary_tables(32, rot)
    positions = np.random.default_rng(1).integers(0, 32, (B, S)).astype(np.int64)
    inputs = {"x": given["x"], "position_ids": given.get("position_ids", positions)}
    inputs.update(cos_cache=cos, sin_cache=sin)
    model = ms_model("RotaryEmbedding", inputs, {"y": F}, **attrs)
    check(model, feeds_of(inputs), compiled=compile_on(model, backend), **tolerance(backend, **TOL))


@pytest.mark.parametrize("segments", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_embed_layer_normalization_matches_onnx_runtime(segments: bool, backend: str) -> None:
    rng = np.random.default_rng(0)
    inputs: dict[str, np.ndarray | None] = {
        "ids": rng.integers(0, 50, (B, S)).astype(np.int32),
        "segment_ids": rng.integers(0, 2, (B, S)).astype(np.int32) if segments else None,
        "word": randn(50, D, seed=1),
        "position": randn(16, D, seed=2),
        "segment": randn(2, D, seed=3) if segments else None,
        "gamma": randn(D, seed=4),
        "beta": randn(D, seed=5),
        "mask": np.array([[1, 1, 1, 0, 0], [1, 1, 2, 1, 1]], np.int32) if segments else None,
    }
    outputs = {"y": F, "mask_index": TensorProto.INT32, "sum": F}
    model = ms_model("EmbedLayerNormalization", inputs, outputs, epsilon=1e-5)
    check(model, feeds_of(inputs), compiled=compile_on(model, backend), **tolerance(backend, **TOL))


def quantized_weights(
    n: int, k: int, bits: int, block: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    blocks = -(-k // block)
    packed = rng.integers(0, 256, (n, blocks, block * bits // 8)).astype(np.uint8)
    scales = (rng.random((n, blocks)) * 0.1 + 0.01).astype(np.float32)
    zeros = rng.integers(0, 256, (n, -(-blocks * bits // 8))).astype(np.uint8)
    return packed, scales, zeros


NBITS_CASES = {
    "4 bits": (4, 32, {}),
    "4 bits, K not a multiple of the block, zero points, bias": (4, 16, {"zeros": 1, "bias": 1}),
    "2 bits": (2, 16, {"zeros": 1}),
    "8 bits": (8, 32, {"zeros": 1}),
    "float zero points": (4, 32, {"float_zeros": 1}),
    "g_idx": (4, 16, {"g_idx": 1}),
}


@pytest.mark.parametrize("case", list(NBITS_CASES))
# The reference interpreter too: it verifies the optimizer's candidates.
@pytest.mark.parametrize("backend", [*BACKENDS, "reference"])
def test_matmul_nbits_matches_onnx_runtime(case: str, backend: str) -> None:
    bits, block, extra = NBITS_CASES[case]
    n, k = 24, 40 if "multiple" in case else 64
    packed, scales, zeros = quantized_weights(n, k, bits, block)
    blocks = packed.shape[1]
    zero_points: np.ndarray | None = None
    if extra.get("zeros"):
        zero_points = zeros
    elif extra.get("float_zeros"):
        zero_points = np.random.default_rng(2).random((n, blocks)).astype(np.float32) * 15
    g_idx = None
    if extra.get("g_idx"):
        g_idx = np.random.default_rng(3).integers(0, blocks, k).astype(np.int32)
    inputs: dict[str, np.ndarray | None] = {
        "a": randn(2, 3, k),  # its shape is symbolic in the model
        "b": packed,
        "scales": scales,
        "zero_points": zero_points,
        "g_idx": g_idx,
        "bias": randn(n, seed=4) if extra.get("bias") else None,
    }
    consts = {name: v for name, v in inputs.items() if name != "a" and v is not None}
    model = ms_model(
        "MatMulNBits",
        inputs,
        {"y": F},
        consts=consts,
        shapes={"a": ["b", "s", k]},
        K=k,
        N=n,
        bits=bits,
        block_size=block,
    )
    compiled = compile_on(model, backend)
    # Without g_idx the weight stays packed (a half byte per int4 weight), unpacked by the
    # product's kernels: a decode row, a few rows, and rows enough for the CPU's GEMM path.
    assert ("block_quant_dot" in compiled.ir()) == (g_idx is None)
    for shape in [(1, 1), (2, 3), (4, 10)]:
        a = randn(*shape, k, seed=sum(shape))
        check(model, {"a": a}, compiled=compiled, **tolerance(backend, **TOL))


def test_matmul_nbits_from_onnx_runtimes_quantizer(tmp_path) -> None:
    """A two-layer MLP quantized to int4 by `onnxruntime.quantization`'s
    `MatMulNBitsQuantizer`, as users make int4 models."""
    quantizer = pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")
    rng = np.random.default_rng(0)
    w1, w2 = rng.standard_normal((64, 96)), rng.standard_normal((96, 32))
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", F, ["b", 64])],
        [helper.make_tensor_value_info("y", F, ["b", 32])],
        [
            numpy_helper.from_array(w1.astype(np.float32), "w1"),
            numpy_helper.from_array(w2.astype(np.float32), "w2"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    q = quantizer.MatMulNBitsQuantizer(model, block_size=32, is_symmetric=False)
    q.process()
    quantized = q.model.model
    assert sum(n.op_type == "MatMulNBits" for n in quantized.graph.node) == 2
    compiled = ember.compile_onnx(quantized)
    for b in (1, 5):
        check(quantized, {"x": randn(b, 64, seed=b)}, compiled=compiled, rtol=1e-4, atol=1e-4)


def test_bert_with_attention_and_embeddings_fused(tmp_path) -> None:
    """`onnxruntime.transformers.optimizer` with every fusion on: EmbedLayerNormalization
    and Attention (the padding mask as the embedding's `mask_index`), plus SkipLayerNorm
    and BiasGelu; then the same file quantized by `quantize_dynamic`. Both compared with
    ONNX Runtime at two shapes, padded sequences included."""
    import warnings

    optimizer = pytest.importorskip("onnxruntime.transformers.optimizer")
    exported, optimized = tmp_path / "bert.onnx", tmp_path / "bert_opt.onnx"
    # The eager attention is what the optimizer recognizes (torch's SDPA export is not).
    export_bert(exported, attn_implementation="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = optimizer.optimize_model(
            str(exported), model_type="bert", num_heads=4, hidden_size=64, opt_level=0
        )
    model.save_model_to_file(str(optimized))
    written = onnx.load(str(optimized))
    fused = {n.op_type for n in written.graph.node if n.domain == MS}
    assert {"Attention", "EmbedLayerNormalization"} <= fused, fused
    # Then quantized as Optimum's O2 + dynamic quantization does: QAttention,
    # QEmbedLayerNormalization and DynamicQuantizeLinear → MatMulInteger.
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantized_path = tmp_path / "bert_q.onnx"
    quantize_dynamic(
        str(optimized),
        str(quantized_path),
        weight_type=QuantType.QInt8,
        # 7-bit weights: ONNX Runtime's own products are exact on every CPU (onnx_util).
        reduce_range=True,
        extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
    )
    quantized = onnx.load(str(quantized_path))
    fused = {n.op_type for n in quantized.graph.node if n.domain == MS}
    assert {"QAttention", "QEmbedLayerNormalization"} <= fused, fused
    compiled = ember.compile_onnx(str(optimized))
    compiled_q = ember.compile_onnx(str(quantized_path))
    for batch, seq in ((2, 7), (3, 4)):
        mask = np.ones((batch, seq), np.int64)
        mask[0, seq - 2 :] = 0
        feeds = {"ids": np.random.default_rng(seq).integers(0, 300, (batch, seq)), "mask": mask}
        check(written, feeds, compiled=compiled, **TOL)
        # The integer products are exact on both sides (7e-7 apart here); activations are
        # quantized at run time, so a value on a rounding tie could land a quantum apart.
        check(quantized, feeds, compiled=compiled_q, rtol=0, atol=1e-3)


def q_attention_inputs(per_column: bool, past: int = 0, s: int = S):
    rng = np.random.default_rng(7)
    width = 3 * D
    w_shape = (width,) if per_column else ()
    inputs: dict[str, np.ndarray | None] = {
        "x": rng.integers(0, 256, (B, s, D)).astype(np.uint8),
        "w": int8_weights(rng, D, width),
        "bias": randn(width, seed=2),
        "x_scale": np.array(0.02, np.float32),
        "w_scale": np.asarray(rng.random(w_shape) * 0.01 + 0.001, np.float32),
        "mask_index": np.array([s + past - 1, s + past], np.int32),
        "x_zero": np.array(128, np.uint8),
        "w_zero": rng.integers(-3, 4, w_shape).astype(np.int8),
        "past": randn(2, B, N, past, H, seed=3) if past else None,
    }
    return inputs


@pytest.mark.parametrize(
    "per_column, past, attrs",
    [(False, 0, {}), (True, 0, {}), (True, 3, {"unidirectional": 1})],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_q_attention_matches_onnx_runtime(per_column, past, attrs, backend: str) -> None:
    """The 8-bit attention of `quantize_dynamic`: its projection is an exact integer product,
    so Ember and ONNX Runtime agree to float rounding."""
    inputs = q_attention_inputs(per_column, past)
    outputs = {"y": F, "present": F} if past else {"y": F}
    model = ms_model("QAttention", inputs, outputs, num_heads=N, **attrs)
    check(model, feeds_of(inputs), compiled=compile_on(model, backend), **tolerance(backend, **TOL))


@pytest.mark.parametrize("backend", BACKENDS)
def test_q_embed_layer_normalization_matches_onnx_runtime(backend: str) -> None:
    rng = np.random.default_rng(0)

    def table(rows: int, seed: int) -> np.ndarray:
        return np.random.default_rng(seed).integers(0, 256, (rows, D)).astype(np.uint8)

    inputs: dict[str, np.ndarray | None] = {
        "ids": rng.integers(0, 50, (B, S)).astype(np.int32),
        "segment_ids": rng.integers(0, 2, (B, S)).astype(np.int32),
        "word": table(50, 1),
        "position": table(16, 2),
        "segment": table(2, 3),
        "gamma": table(1, 4)[0],
        "beta": table(1, 5)[0],
        "mask": np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.int32),
    }
    for k, name in enumerate(("word", "position", "segment", "gamma", "beta")):
        inputs[f"{name}_scale"] = np.array(0.01 * (k + 1), np.float32)
    for k, name in enumerate(("word", "position", "segment", "gamma", "beta")):
        inputs[f"{name}_zero"] = np.array(100 + k, np.uint8)
    outputs = {"y": F, "mask_index": TensorProto.INT32}
    model = ms_model("QEmbedLayerNormalization", inputs, outputs, epsilon=1e-5)
    check(model, feeds_of(inputs), compiled=compile_on(model, backend), **tolerance(backend, **TOL))
