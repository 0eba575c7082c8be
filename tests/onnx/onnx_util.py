"""Helpers for the ONNX tests: build one-node models with ``onnx.helper`` and compare Ember
with ONNX Runtime on the same random inputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ember
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import CHECK_ON
from onnx import TensorProto, helper, numpy_helper

RTOL, ATOL = 1.3e-6, 1e-5
# GPU math (exp, tanh, reduction order) differs from the host's in the last bits.
GPU_RTOL, GPU_ATOL = 1e-4, 1e-4

# The backends an ONNX test can run on: the CPU; the CUDA backend's kernels run on the host
# by its emulator; and the GPU (marked `cuda`, skipped without one).
BACKEND_NAMES = ["cpu"] + (["cuda-emu", "cuda"] if ember.cuda.cuda_built() else [])
_CUDA_MARKS = [
    pytest.mark.cuda,
    pytest.mark.skipif(not ember.cuda_available(), reason="needs an NVIDIA GPU"),
]


def with_backend(values: Sequence[Any], backend: str) -> Any:
    """A parametrize entry of `values` and then `backend`, with the marks it needs."""
    return pytest.param(*values, backend, marks=_CUDA_MARKS if backend == "cuda" else ())


BACKENDS = [with_backend((), b) for b in BACKEND_NAMES]


def compile_on(model: Any, backend: str, **options: Any) -> Any:
    """`model` compiled by Ember for `backend` ("cuda": the GPU, numpy in and out)."""
    if backend == "cuda":
        return ember.compile_onnx(model, device="cuda", **options)
    return ember.compile_onnx(model, backend=backend, **options)


def tolerance(backend: str, rtol: float = RTOL, atol: float = ATOL) -> dict[str, float]:
    """`rtol` and `atol`, no tighter than GPU math allows on "cuda"."""
    if backend == "cuda":
        return {"rtol": max(rtol, GPU_RTOL), "atol": max(atol, GPU_ATOL)}
    return {"rtol": rtol, "atol": atol}


def value_info(name: str, arr_or_type: Any, shape: Sequence[Any] | None = None):
    if isinstance(arr_or_type, np.ndarray):
        elem = helper.np_dtype_to_tensor_dtype(arr_or_type.dtype)
        return helper.make_tensor_value_info(name, elem, list(arr_or_type.shape))
    return helper.make_tensor_value_info(name, arr_or_type, shape)


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: dict[str, np.ndarray],
    outputs: Sequence[str],
    initializers: dict[str, np.ndarray] | None = None,
    opset: int = 18,
    input_shapes: dict[str, Sequence[Any]] | None = None,
) -> onnx.ModelProto:
    """A model over ``inputs`` (their dtypes and shapes, or ``input_shapes`` overrides)."""
    input_shapes = input_shapes or {}
    ins = [
        helper.make_tensor_value_info(
            n,
            helper.np_dtype_to_tensor_dtype(a.dtype),
            list(input_shapes.get(n, a.shape)),
        )
        for n, a in inputs.items()
    ]
    outs = [helper.make_empty_tensor_value_info(n) for n in outputs]
    inits = [numpy_helper.from_array(a, n) for n, a in (initializers or {}).items()]
    graph = helper.make_graph(list(nodes), "g", ins, outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    # Declare the output types (as exporters do) so Ember checks its result against them.
    inferred = onnx.shape_inference.infer_shapes(model)
    del model.graph.output[:]
    model.graph.output.extend(inferred.graph.output)
    return model


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def check(
    model: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    rtol: float = RTOL,
    atol: float = ATOL,
    compiled: Any = None,
) -> list[np.ndarray]:
    """Runs Ember (``compiled``, or the model compiled for the test's ``check_backend``,
    see tests/conftest.py) and ONNX Runtime on ``feeds`` and asserts the outputs match."""
    want = ort_run(model, feeds)
    runner = compiled or compile_on(model, CHECK_ON["backend"])
    if getattr(runner, "device", "cpu") == "cuda":
        rtol, atol = max(rtol, GPU_RTOL), max(atol, GPU_ATOL)
    got = runner(**feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert isinstance(g, np.ndarray)
        assert g.dtype == w.dtype, (g.dtype, w.dtype)
        assert g.shape == w.shape, (g.shape, w.shape)
        if w.dtype.kind == "f":
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
        else:
            np.testing.assert_array_equal(g, w)
    return got


def single(
    op: str,
    inputs: dict[str, np.ndarray],
    attrs: dict[str, Any] | None = None,
    outputs: int | Sequence[str] = 1,
    initializers: dict[str, np.ndarray] | None = None,
    opset: int = 18,
    input_names: Sequence[str] | None = None,
) -> onnx.ModelProto:
    """A model with one ``op`` node; its inputs are ``input_names`` (default: runtime inputs
    then initializers, in the given order)."""
    outs = [f"y{i}" for i in range(outputs)] if isinstance(outputs, int) else list(outputs)
    names = list(input_names) if input_names is not None else [*inputs, *(initializers or {})]
    node = helper.make_node(op, names, outs, name=f"{op.lower()}_node", **(attrs or {}))
    return make_model([node], inputs, [o for o in outs if o], initializers, opset)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# ONNX Runtime's uint8 × int8 products on CPUs without VNNI (AVX2's `vpmaddubsw`) add
# pairs of products in saturating int16: with int8 weights of 8 bits its results are wrong
# there (255·127·2 > 32767), which is why its quantizer has `reduce_range`. Tests that use
# it as the reference for such products draw int8 weights from 7 bits, which every CPU
# multiplies exactly; the full range is checked against numpy's int64 products.
ORT_EXACT_INT8 = (-64, 64)


def int8_weights(g: np.random.Generator, *shape: int) -> np.ndarray:
    """Random int8 weights that ONNX Runtime multiplies by uint8 exactly on every CPU."""
    return g.integers(*ORT_EXACT_INT8, size=shape, dtype=np.int8)


def randn(*shape: int, seed: int = 0, dtype: Any = np.float32) -> np.ndarray:
    return rng(seed).standard_normal(shape).astype(dtype)


def ints(*shape: int, low: int = -5, high: int = 6, seed: int = 0, dtype: Any = np.int64):
    return rng(seed).integers(low, high, size=shape).astype(dtype)


def calibration(batches: Sequence[dict[str, np.ndarray]]) -> Any:
    """An ``onnxruntime.quantization`` calibration reader that yields ``batches``."""
    from onnxruntime import quantization

    class Reader(quantization.CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter(batches)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.batches, None)

    return Reader()


def export_bert(path: Any, attn_implementation: str | None = None, **config: Any) -> None:
    """A random Hugging Face BERT (its last hidden state from inputs `ids` and `mask`, batch
    and length dynamic) written to `path` by torch's TorchScript exporter at opset 17.
    `config` overrides the small default sizes; vocabulary 300 unless given."""
    import warnings

    import torch

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    sizes = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=300,
    )
    config_ = transformers.BertConfig(**{**sizes, **config})
    if attn_implementation is None:
        bert = transformers.BertModel(config_).eval()
    else:
        bert = transformers.BertModel._from_config(
            config_, attn_implementation=attn_implementation
        ).eval()

    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.bert(input_ids=ids, attention_mask=mask).last_hidden_state

    ids = torch.randint(0, config_.vocab_size, (2, 7))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Hidden().eval(),
            (ids, torch.ones(2, 7, dtype=torch.long)),
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=["ids", "mask"],
            dynamic_axes={"ids": {0: "b", 1: "s"}, "mask": {0: "b", 1: "s"}},
        )


__all__ = [
    "BACKENDS",
    "BACKEND_NAMES",
    "TensorProto",
    "calibration",
    "check",
    "compile_on",
    "export_bert",
    "int8_weights",
    "ints",
    "make_model",
    "ort_run",
    "randn",
    "single",
    "tolerance",
    "with_backend",
]
