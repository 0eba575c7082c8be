"""ONNX Runtime's fused `com.microsoft` ops (what its transformer optimizer writes) against
ONNX Runtime itself, and a BERT optimized by `onnxruntime.transformers.optimizer`."""

from __future__ import annotations

from typing import Any

import ember
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx_util import BACKENDS, check, compile_on, export_bert, randn, tolerance

MS = "com.microsoft"
TOL = {"rtol": 1e-5, "atol": 1e-5}


def contrib_model(
    op: str,
    inputs: dict[str, np.ndarray],
    outputs: list[str],
    domain: str = MS,
    **attrs: Any,
) -> onnx.ModelProto:
    """One `op` node over `inputs` (an empty name: an absent optional input)."""
    names = [k if v is not None else "" for k, v in inputs.items()]
    given = {k: v for k, v in inputs.items() if v is not None}
    node = helper.make_node(op, names, outputs, domain=domain, name="fused", **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for k, v in given.items()
        ],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs if o],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


X, H = randn(2, 3, 8), 8
CASES = {
    "FusedMatMul transB alpha": (
        "FusedMatMul",
        {"a": randn(2, 3, 4), "b": randn(2, 5, 4, seed=1)},
        {"transB": 1, "alpha": 0.5},
    ),
    "FusedMatMul transA": (
        "FusedMatMul",
        {"a": randn(4, 3), "b": randn(4, 5, seed=1)},
        {"transA": 1},
    ),
    "Gelu": ("Gelu", {"x": X}, {}),
    "BiasGelu": ("BiasGelu", {"x": X, "b": randn(H, seed=1)}, {}),
    "FastGelu": ("FastGelu", {"x": X, "b": randn(H, seed=1)}, {}),
    "FastGelu no bias": ("FastGelu", {"x": X}, {}),
    "QuickGelu": ("QuickGelu", {"x": X}, {}),
    "QuickGelu alpha": ("QuickGelu", {"x": X}, {"alpha": 1.0}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_op_matches_onnx_runtime(case: str, backend: str) -> None:
    op, inputs, attrs = CASES[case]
    model = contrib_model(op, inputs, ["y"], **attrs)
    check(model, inputs, compiled=compile_on(model, backend), **tolerance(backend, **TOL))


def skip_inputs(beta: bool, bias: bool, simplified: bool) -> dict[str, np.ndarray | None]:
    inputs: dict[str, np.ndarray | None] = {
        "x": randn(2, 3, H) * 3,
        "skip": randn(2, 3, H, seed=1),
        "gamma": randn(H, seed=2),
    }
    if not simplified:
        inputs["beta"] = randn(H, seed=3) if beta else None
    inputs["bias"] = randn(H, seed=4) if bias else None
    return inputs


@pytest.mark.parametrize("simplified", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_skip_normalizations_give_the_normalized_sum_and_the_sum(simplified, bias, backend):
    op = "SkipSimplifiedLayerNormalization" if simplified else "SkipLayerNormalization"
    inputs = skip_inputs(beta=True, bias=bias, simplified=simplified)
    model = contrib_model(op, inputs, ["y", "", "", "sum"], epsilon=1e-5)
    feeds = {k: v for k, v in inputs.items() if v is not None}
    check(model, feeds, compiled=compile_on(model, backend), **tolerance(backend, **TOL))


def test_skip_layer_norm_default_epsilon_and_onnx_domain_simplified_norm() -> None:
    inputs = skip_inputs(beta=False, bias=False, simplified=False)
    model = contrib_model("SkipLayerNormalization", inputs, ["y"])
    check(model, {k: v for k, v in inputs.items() if v is not None}, **TOL)
    # ONNX Runtime registers SimplifiedLayerNormalization in the ai.onnx domain.
    inputs = {"x": randn(2, 3, H), "scale": randn(H, seed=1)}
    check(contrib_model("SimplifiedLayerNormalization", inputs, ["y"], domain=""), inputs, **TOL)


def test_training_outputs_are_refused_naming_the_node() -> None:
    inputs = skip_inputs(beta=True, bias=False, simplified=False)
    model = contrib_model("SkipLayerNormalization", inputs, ["y", "mean"])
    with pytest.raises(ember.UnsupportedOpError, match="SkipLayerNormalization.*fused.*mean"):
        ember.compile_onnx(model)


def test_bert_optimized_by_onnx_runtimes_transformer_optimizer(tmp_path) -> None:
    """`onnxruntime.transformers.optimizer` rewrites an exported BERT with BiasGelu and
    SkipLayerNormalization (its Attention and EmbedLayerNormalization fusions off, as
    users who want Ember to recover attention itself optimize); the optimized file
    compiles and matches ONNX Runtime. `test_onnx_ms_attention.py` has those fusions on."""
    import warnings

    optimizer = pytest.importorskip("onnxruntime.transformers.optimizer")
    from onnxruntime.transformers.fusion_options import FusionOptions

    exported, optimized = tmp_path / "bert.onnx", tmp_path / "bert_opt.onnx"
    export_bert(exported)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        options = FusionOptions("bert")
        options.enable_attention = False
        options.enable_embed_layer_norm = False
        model = optimizer.optimize_model(
            str(exported),
            model_type="bert",
            num_heads=4,
            hidden_size=64,
            optimization_options=options,
            opt_level=0,
        )
    model.save_model_to_file(str(optimized))
    written = onnx.load(str(optimized))
    fused = {n.op_type for n in written.graph.node if n.domain == MS}
    assert {"BiasGelu", "SkipLayerNormalization"} <= fused, fused
    compiled = ember.compile_onnx(str(optimized))
    for batch, seq in ((2, 7), (1, 4)):
        feeds = {
            "ids": np.random.default_rng(seq).integers(0, 300, (batch, seq)),
            "mask": np.ones((batch, seq), np.int64),
        }
        check(written, feeds, compiled=compiled, **TOL)
