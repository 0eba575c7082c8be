"""Every supported ONNX op, built with ``onnx.helper`` and compared with ONNX Runtime on
random inputs (fp32: rtol 1.3e-6 / atol 1e-5 unless a case says why it needs more)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ember
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_util import BACKENDS, check, compile_on, ints, make_model, ort_run, randn, single

X = randn(3, 4, 5)
POS = np.abs(randn(3, 4, 5, seed=1)) + 0.1
B = randn(4, 5, seed=2)
F32 = TensorProto.FLOAT


def unary(op: str, x: np.ndarray = X, **attrs: Any) -> Callable[[], tuple]:
    return lambda: (single(op, {"x": x}, attrs), {"x": x})


def binary(op: str, a: np.ndarray = X, b: np.ndarray = B, **attrs: Any) -> Callable[[], tuple]:
    return lambda: (single(op, {"a": a, "b": b}, attrs), {"a": a, "b": b})


def with_consts(
    op: str,
    x: np.ndarray,
    consts: dict[str, np.ndarray | None],
    attrs: dict[str, Any] | None = None,
    outputs: int = 1,
    opset: int = 18,
) -> Callable[[], tuple]:
    """One node whose input 0 is ``x`` and the rest initializers (None: absent input)."""

    def build():
        inits = {k: v for k, v in consts.items() if v is not None}
        names = ["x", *(k if v is not None else "" for k, v in consts.items())]
        model = single(op, {"x": x}, attrs, outputs, inits, opset, input_names=names)
        return model, {"x": x}

    return build


def i64(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


XNAN = X.copy()
XNAN[0, 0, :2] = np.nan
XINF = X.copy()
XINF[1, 1, :2] = [np.inf, -np.inf]
BOOL_A = ints(3, 4, 5, low=0, high=2, seed=3).astype(bool)
BOOL_B = ints(4, 5, low=0, high=2, seed=4).astype(bool)
IA = ints(3, 4, 5, low=-9, high=10, seed=5)
IB = ints(4, 5, low=1, high=5, seed=6) * np.where(ints(4, 5, low=0, high=2, seed=7) > 0, 1, -1)
TIES = ints(3, 4, 5, low=0, high=3, seed=8).astype(np.float32)
IMG = randn(2, 6, 5, 4, seed=9)

CASES: dict[str, Callable[[], tuple]] = {
    # Elementwise unary.
    "Sqrt": unary("Sqrt", POS),
    "Neg": unary("Neg"),
    "Abs": unary("Abs"),
    "Reciprocal": unary("Reciprocal", POS),
    "Exp": unary("Exp"),
    "Log": unary("Log", POS),
    "Sin": unary("Sin"),
    "Cos": unary("Cos"),
    "Tan": unary("Tan"),
    "Tanh": unary("Tanh"),
    "Sigmoid": unary("Sigmoid"),
    "Relu": unary("Relu"),
    "Erf": unary("Erf"),
    "Floor": unary("Floor", X * 3),
    "Ceil": unary("Ceil", X * 3),
    "Sign": unary("Sign", np.round(X)),
    "Round": unary("Round", X * 3),
    "IsNaN": unary("IsNaN", XNAN),
    "IsInf": unary("IsInf", XINF),
    "IsInf_positive": unary("IsInf", XINF, detect_negative=0),
    "Not": unary("Not", BOOL_A),
    "LeakyRelu": unary("LeakyRelu", alpha=0.1),
    "HardSigmoid": unary("HardSigmoid", X * 4, alpha=0.3, beta=0.4),
    "HardSwish": unary("HardSwish", X * 4),
    "Elu": unary("Elu", alpha=0.7),
    "Selu": unary("Selu"),
    "Gelu": lambda: (single("Gelu", {"x": X}, opset=20), {"x": X}),
    "Gelu_tanh": lambda: (
        single("Gelu", {"x": X}, {"approximate": "tanh"}, opset=20),
        {"x": X},
    ),
    "PRelu": with_consts("PRelu", X, {"slope": randn(5, seed=3)}),
    "Softmax": unary("Softmax", axis=1),
    "LogSoftmax": unary("LogSoftmax"),
    "Clip": with_consts(
        "Clip", X, {"lo": np.array(-0.5, np.float32), "hi": np.array(0.7, np.float32)}
    ),
    "Clip_min_only": with_consts("Clip", X, {"lo": np.array(-0.5, np.float32)}),
    "Clip_max_only": with_consts("Clip", X, {"lo": None, "hi": np.array(0.2, np.float32)}),
    # Broadcasting binary ops.
    "Add": binary("Add"),
    "Sub": binary("Sub"),
    "Mul": binary("Mul"),
    "Div": binary("Div", X, B + 3),
    "Div_int": binary("Div", IA, IB),
    "Mod_int": binary("Mod", IA, IB),
    "Mod_fmod": binary("Mod", IA.astype(np.float32), IB.astype(np.float32), fmod=1),
    "Pow": binary("Pow", POS, B),
    "Pow_int_exponent": binary("Pow", X, ints(4, 5, low=0, high=4)),
    "Equal": binary("Equal", IA, IB),
    "Less": binary("Less"),
    "Greater": binary("Greater"),
    "LessOrEqual": binary("LessOrEqual", IA, IB),
    "GreaterOrEqual": binary("GreaterOrEqual", IA, IB),
    "And": binary("And", BOOL_A, BOOL_B),
    "Or": binary("Or", BOOL_A, BOOL_B),
    "Xor": binary("Xor", BOOL_A, BOOL_B),
    "Min": lambda: (
        single("Min", {"a": X, "b": B, "c": randn(5, seed=4)}),
        {"a": X, "b": B, "c": randn(5, seed=4)},
    ),
    "Max": lambda: (
        single("Max", {"a": X, "b": B, "c": randn(5, seed=4)}),
        {"a": X, "b": B, "c": randn(5, seed=4)},
    ),
    "Sum": lambda: (
        single("Sum", {"a": X, "b": B, "c": randn(5, seed=4)}),
        {"a": X, "b": B, "c": randn(5, seed=4)},
    ),
    "Mean": lambda: (
        single("Mean", {"a": X, "b": B, "c": randn(5, seed=4)}),
        {"a": X, "b": B, "c": randn(5, seed=4)},
    ),
    "Where": lambda: (
        single("Where", {"c": BOOL_B, "a": X, "b": randn(5, seed=5)}),
        {"c": BOOL_B, "a": X, "b": randn(5, seed=5)},
    ),
    # Types.
    "Cast_to_int32": unary("Cast", X * 10, to=TensorProto.INT32),
    "Cast_to_float": unary("Cast", IA, to=F32),
    "Cast_to_bool": unary("Cast", np.round(X), to=TensorProto.BOOL),
    "CastLike": lambda: (
        single("CastLike", {"x": IA, "like": X}),
        {"x": IA, "like": X},
    ),
    "Identity": unary("Identity"),
    "Dropout": lambda: (single("Dropout", {"x": X}, outputs=2), {"x": X}),
    # Matrix products.
    "MatMul_3d_2d": binary("MatMul", X, randn(5, 6, seed=3)),
    "MatMul_batch_broadcast": binary("MatMul", randn(2, 1, 3, 4), randn(5, 4, 6, seed=1)),
    "MatMul_vec_mat": binary("MatMul", randn(4), randn(2, 4, 3, seed=1)),
    "MatMul_mat_vec": binary("MatMul", randn(2, 3, 4), randn(4, seed=1)),
    "Gemm": lambda: (
        single("Gemm", {"a": randn(3, 4), "b": randn(4, 5, seed=1), "c": randn(5, seed=2)}),
        {"a": randn(3, 4), "b": randn(4, 5, seed=1), "c": randn(5, seed=2)},
    ),
    "Gemm_trans_alpha_beta": lambda: (
        single(
            "Gemm",
            {"a": randn(4, 3), "b": randn(5, 4, seed=1), "c": randn(3, 1, seed=2)},
            {"transA": 1, "transB": 1, "alpha": 0.5, "beta": 2.0},
        ),
        {"a": randn(4, 3), "b": randn(5, 4, seed=1), "c": randn(3, 1, seed=2)},
    ),
    "Einsum_bmm": binary("Einsum", randn(2, 3, 4), randn(2, 4, 5, seed=1), equation="bij,bjk->bik"),
    "Einsum_attention": binary(
        "Einsum", randn(2, 3, 4, 5), randn(2, 3, 6, 5, seed=1), equation="bhqd,bhkd->bhqk"
    ),
    "Einsum_transpose": unary("Einsum", randn(3, 4), equation="ij->ji"),
    "Einsum_diagonal": unary("Einsum", randn(4, 4), equation="ii->i"),
    "Einsum_trace": unary("Einsum", randn(4, 4), equation="ii"),
    "Einsum_batch_diagonal": unary("Einsum", randn(2, 3, 5, 3), equation="biji->bji"),
    "Einsum_triple_diagonal": unary("Einsum", randn(3, 2, 3, 3), equation="ijii->ji"),
    "Einsum_diagonal_product": binary(
        "Einsum", randn(3, 4, 3), randn(4, 5, seed=1), equation="iji,jk->ik"
    ),
    "Einsum_sum": unary("Einsum", randn(3, 4), equation="ij->i"),
    "Einsum_implicit_dot": binary("Einsum", randn(6), randn(6, seed=1), equation="i,i"),
    "Einsum_ellipsis": binary(
        "Einsum", randn(2, 3, 4), randn(4, 5, seed=1), equation="...ij,jk->...ik"
    ),
    # Normalizations and pooling.
    "LayerNormalization": lambda: (
        single(
            "LayerNormalization",
            {"x": X},
            {"epsilon": 1e-3},
            initializers={"w": randn(5, seed=1), "b": randn(5, seed=2)},
        ),
        {"x": X},
    ),
    "LayerNormalization_axis1": lambda: (
        single(
            "LayerNormalization",
            {"x": X},
            {"axis": 1},
            initializers={"w": randn(4, 5, seed=1)},
        ),
        {"x": X},
    ),
    "GroupNormalization_opset18": lambda: (
        single(
            "GroupNormalization",
            {"x": IMG},
            {"num_groups": 3},
            initializers={"s": randn(3, seed=1), "b": randn(3, seed=2)},
            opset=18,
        ),
        {"x": IMG},
    ),
    "GroupNormalization_opset21": lambda: (
        single(
            "GroupNormalization",
            {"x": IMG},
            {"num_groups": 2, "epsilon": 1e-3},
            initializers={"s": randn(6, seed=1), "b": randn(6, seed=2)},
            opset=21,
        ),
        {"x": IMG},
    ),
    "BatchNormalization": lambda: (
        single(
            "BatchNormalization",
            {"x": IMG},
            initializers={
                "s": randn(6, seed=1),
                "b": randn(6, seed=2),
                "m": randn(6, seed=3),
                "v": np.abs(randn(6, seed=4)) + 0.5,
            },
        ),
        {"x": IMG},
    ),
    "InstanceNormalization": lambda: (
        single(
            "InstanceNormalization",
            {"x": IMG},
            initializers={"s": randn(6, seed=1), "b": randn(6, seed=2)},
        ),
        {"x": IMG},
    ),
    "GlobalAveragePool": unary("GlobalAveragePool", IMG),
    "GlobalMaxPool": unary("GlobalMaxPool", IMG),
    # Reductions (axes as an input from opset 18).
    "ReduceSum": with_consts("ReduceSum", X, {"axes": i64(1)}),
    "ReduceSum_opset13_all": with_consts("ReduceSum", X, {}, {"keepdims": 0}, opset=13),
    "ReduceMean": with_consts("ReduceMean", X, {"axes": i64(0, -1)}, {"keepdims": 0}),
    "ReduceMean_opset13_attr": lambda: (
        single("ReduceMean", {"x": X}, {"axes": [2]}, opset=13),
        {"x": X},
    ),
    "ReduceMax": with_consts("ReduceMax", X, {"axes": i64(2)}),
    "ReduceMin": with_consts("ReduceMin", X, {"axes": i64(1)}, {"keepdims": 0}),
    "ReduceProd": with_consts("ReduceProd", X, {"axes": i64(1)}),
    "ReduceL1": with_consts("ReduceL1", X, {"axes": i64(2)}),
    "ReduceL2": with_consts("ReduceL2", X, {"axes": i64(2)}),
    "ReduceSumSquare": with_consts("ReduceSumSquare", X, {"axes": i64(0)}),
    "ReduceLogSum": with_consts("ReduceLogSum", POS, {"axes": i64(1)}),
    "ReduceLogSumExp": with_consts("ReduceLogSumExp", X, {"axes": i64(1)}, {"keepdims": 0}),
    "ReduceSum_int": with_consts("ReduceSum", IA, {"axes": i64(1)}),
    "ArgMax": unary("ArgMax", TIES, axis=1),
    "ArgMin_last": unary("ArgMin", TIES, axis=2, keepdims=0, select_last_index=1),
    "ArgMax_last": unary("ArgMax", TIES, axis=-1, select_last_index=1),
    # Shape and layout.
    "Transpose": unary("Transpose", perm=[2, 0, 1]),
    "Transpose_default": unary("Transpose"),
    "Concat": lambda: (
        single("Concat", {"a": X, "b": randn(3, 2, 5, seed=1)}, {"axis": 1}),
        {"a": X, "b": randn(3, 2, 5, seed=1)},
    ),
    "Reshape": with_consts("Reshape", X, {"shape": i64(0, -1)}),
    "Flatten": unary("Flatten", axis=2),
    "Expand": with_consts("Expand", randn(3, 1, 5), {"shape": i64(2, 1, 4, 1)}),
    "Unsqueeze": with_consts("Unsqueeze", X, {"axes": i64(0, -1)}),
    "Squeeze": with_consts("Squeeze", randn(3, 1, 5, 1), {"axes": i64(-1)}),
    "Squeeze_all": unary("Squeeze", randn(3, 1, 5, 1)),
    "Slice": with_consts(
        "Slice", X, {"s": i64(1, -4), "e": i64(2**62, -1), "a": i64(1, 2), "st": i64(1, 2)}
    ),
    "Slice_negative_step": with_consts(
        "Slice", X, {"s": i64(-1, 3), "e": i64(-(2**62), 0), "a": i64(0, 2), "st": i64(-1, -2)}
    ),
    "Split": with_consts("Split", X, {"split": i64(1, 3)}, {"axis": 1}, outputs=2),
    "Split_num_outputs": lambda: (
        single("Split", {"x": X}, {"axis": 2, "num_outputs": 2}, outputs=2),
        {"x": X},
    ),
    "Tile": with_consts("Tile", randn(2, 3), {"r": i64(2, 3)}),
    "Pad": with_consts("Pad", X, {"pads": i64(1, 0, 2, 0, -1, 1), "v": np.array(1.5, np.float32)}),
    "Pad_axes": with_consts("Pad", X, {"pads": i64(2, 1), "v": None, "axes": i64(-1)}),
    "Pad_edge": with_consts("Pad", X, {"pads": i64(1, 0, 2, 0, 1, 3)}, {"mode": "edge"}),
    "Pad_reflect": with_consts("Pad", X, {"pads": i64(0, 2, 3, 0, 1, 4)}, {"mode": "reflect"}),
    "Pad_wrap": with_consts("Pad", X, {"pads": i64(1, 3, -1, 2, 0, 2)}, {"mode": "wrap"}),
    "Shape": unary("Shape", X, start=1),
    "Size": unary("Size"),
    # Indexing.
    "Gather": with_consts("Gather", X, {"i": ints(2, 3, low=-4, high=4)}, {"axis": 1}),
    "Gather_scalar": with_consts("Gather", X, {"i": np.array(-1, np.int64)}),
    "GatherElements": with_consts(
        "GatherElements", X, {"i": ints(3, 2, 5, low=-4, high=4)}, {"axis": 1}
    ),
    "GatherND": with_consts("GatherND", X, {"i": ints(2, 2, low=-3, high=3)}),
    "GatherND_full": with_consts(
        "GatherND", X, {"i": np.array([[0, 1, 2], [2, -1, -5]], np.int64)}
    ),
    "GatherND_batch1": with_consts(
        "GatherND", X, {"i": ints(3, 2, 1, low=-4, high=4)}, {"batch_dims": 1}
    ),
    "GatherND_batch2": with_consts(
        "GatherND", X, {"i": ints(3, 4, 2, 1, low=-5, high=5)}, {"batch_dims": 2}
    ),
    "OneHot": lambda: (
        single(
            "OneHot",
            {"i": ints(3, 4, low=-5, high=5)},
            {"axis": 1},
            initializers={"d": np.array(5, np.int64), "v": np.array([-1.0, 2.0], np.float32)},
        ),
        {"i": ints(3, 4, low=-5, high=5)},
    ),
    "CumSum": with_consts("CumSum", X, {"axis": np.array(1, np.int64)}),
    "CumSum_exclusive_reverse": with_consts(
        "CumSum", X, {"axis": np.array(-1, np.int64)}, {"exclusive": 1, "reverse": 1}
    ),
    "Trilu_upper": with_consts("Trilu", X, {"k": np.array(1, np.int64)}),
    "Trilu_lower": unary("Trilu", X, upper=0),
    "EyeLike": unary("EyeLike", B),
    "EyeLike_k_dtype": unary("EyeLike", B, k=-2, dtype=TensorProto.INT32),
    "EyeLike_wide": unary("EyeLike", randn(3, 7, seed=14), k=3),
    # Creation.
    "Range_int": lambda: (
        single(
            "Range",
            {},
            initializers={
                "s": np.array(2, np.int64),
                "l": np.array(-7, np.int64),
                "d": np.array(-3, np.int64),
            },
        ),
        {},
    ),
    "Range_float": lambda: (
        single(
            "Range",
            {},
            initializers={
                "s": np.array(0.5, np.float32),
                "l": np.array(3.0, np.float32),
                "d": np.array(0.25, np.float32),
            },
        ),
        {},
    ),
}


def _constant_models() -> dict[str, Callable[[], tuple]]:
    """Constant and ConstantOfShape feeding an Add, so the model has an input."""

    def constant():
        c = helper.make_node(
            "Constant", [], ["c"], value=numpy_helper.from_array(randn(4, 5, seed=7))
        )
        add = helper.make_node("Add", ["x", "c"], ["y"])
        return make_model([c, add], {"x": X}, ["y"]), {"x": X}

    def constant_of_shape():
        s = helper.make_node("Shape", ["x"], ["s"])
        c = helper.make_node(
            "ConstantOfShape",
            ["s"],
            ["c"],
            value=numpy_helper.from_array(np.array([2.5], np.float32)),
        )
        add = helper.make_node("Add", ["x", "c"], ["y"])
        return make_model([s, c, add], {"x": X}, ["y"]), {"x": X}

    return {"Constant": constant, "ConstantOfShape": constant_of_shape}


CASES.update(_constant_models())

# Functions the IR composes from its own ops (`frontend/onnx/ops/math.rs`), over inputs that
# reach their hard regions: large magnitudes, the ends of (-1, 1), values near 1 for Acosh.
WIDE = randn(3, 4, 5, seed=9) * 30
UNIT = np.clip(randn(3, 4, 5, seed=10), -0.9999, 0.9999).astype(np.float32)
UNIT[0, 0, :3] = [-1.0, 1.0, 0.0]
TINY = (randn(3, 4, 5, seed=11) * 1e-4).astype(np.float32)
ABOVE_ONE = (1 + np.abs(randn(3, 4, 5, seed=12)) ** 3).astype(np.float32)
ABOVE_ONE[0, 0, :3] = [1.0, 1.0000001, 1e20]
HUGE = (randn(3, 4, 5, seed=13) * 1e20).astype(np.float32)
CASES.update(
    {
        "Softplus": unary("Softplus", WIDE),
        "Mish": unary("Mish", WIDE),
        "Celu": unary("Celu", X * 3, alpha=0.7),
        "Softsign": unary("Softsign", WIDE),
        "ThresholdedRelu": unary("ThresholdedRelu", X, alpha=0.3),
        "Shrink": unary("Shrink", X * 2, bias=0.4, lambd=0.7),
        "Atan": unary("Atan", WIDE),
        "Asin": unary("Asin", UNIT),
        "Acos": unary("Acos", UNIT),
        "Atanh": unary("Atanh", UNIT),
        "Sinh": unary("Sinh", X * 4),
        "Sinh_tiny": unary("Sinh", TINY),
        "Cosh": unary("Cosh", X * 4),
        "Asinh": unary("Asinh", WIDE),
        "Asinh_tiny": unary("Asinh", TINY),
        "Asinh_huge": unary("Asinh", HUGE),
        "Acosh": unary("Acosh", ABOVE_ONE),
        "DepthToSpace_DCR": unary("DepthToSpace", randn(2, 8, 3, 4), blocksize=2),
        "DepthToSpace_CRD": unary("DepthToSpace", randn(2, 18, 2, 3), blocksize=3, mode="CRD"),
        "SpaceToDepth": unary("SpaceToDepth", randn(2, 3, 4, 6), blocksize=2),
    }
)

# Reductions and normalizations sum in a different order than ONNX Runtime; exp/log/pow/erf
# and the trig functions use different (correctly rounded to a few ulp) implementations.
LOOSE = {
    "ReduceProd": 1e-5,
    "ReduceLogSumExp": 1e-5,
    "Pow": 1e-5,
    "GroupNormalization_opset18": 1e-5,
    "GroupNormalization_opset21": 1e-5,
    "InstanceNormalization": 1e-5,
    "LayerNormalization": 1e-5,
    "LayerNormalization_axis1": 1e-5,
    "Tan": 1e-5,
    # Composed from exp/log1p/atan2 (ONNX Runtime calls the C library's functions).
    "Softplus": 1e-5,
    "Mish": 1e-5,
    "Celu": 1e-5,
    "Atan": 1e-5,
    "Asin": 1e-5,
    "Acos": 1e-5,
    "Atanh": 1e-5,
    "Sinh": 1e-5,
    "Sinh_tiny": 1e-5,
    "Cosh": 1e-5,
    "Asinh": 1e-5,
    "Asinh_tiny": 1e-5,
    "Asinh_huge": 1e-5,
    "Acosh": 1e-5,
}


@pytest.mark.usefixtures("check_backend")
@pytest.mark.parametrize("name", sorted(CASES))
def test_op_matches_onnxruntime(name: str) -> None:
    model, feeds = CASES[name]()
    rtol = LOOSE.get(name, 1.3e-6)
    check(model, feeds, rtol=rtol)


REQUIRED = """Add Sub Mul Div Mod Pow Sqrt Neg Abs Reciprocal Exp Log Sin Cos Tanh Sigmoid Relu
LeakyRelu HardSigmoid Erf Gelu Floor Ceil IsNaN Softmax LogSoftmax Clip Equal Less Greater
LessOrEqual GreaterOrEqual Not And Or Xor Min Max Sum Mean Where Constant ConstantOfShape Cast
CastLike Identity MatMul Gemm Einsum LayerNormalization GroupNormalization BatchNormalization
InstanceNormalization Transpose Concat Reshape Shape Size Expand Unsqueeze Squeeze Flatten Slice
Split Gather GatherND GatherElements ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd ReduceL2
ArgMax ArgMin Trilu OneHot Range CumSum GlobalAveragePool Pad Tile Dropout""".split()


def test_every_supported_op_has_a_case() -> None:
    covered = {name.split("_")[0] for name in CASES}
    assert set(REQUIRED) - covered == set()


def _axes_case(op: str, opset: int, axes: list[int], **attrs: Any) -> tuple:
    """Reductions took ``axes`` as an attribute before opset 18 (ReduceSum: before 13)."""
    as_input = opset >= 18 or op == "ReduceSum"
    if as_input:
        return with_consts(op, X, {"axes": np.array(axes, np.int64)}, attrs, opset=opset)()
    model = single(op, {"x": X}, {"axes": axes, **attrs}, opset=opset)
    return model, {"x": X}


@pytest.mark.usefixtures("check_backend")
@pytest.mark.parametrize("opset", [13, 17, 18, 21])
@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceL2"])
def test_reduce_axes_attribute_or_input(op: str, opset: int) -> None:
    model, feeds = _axes_case(op, opset, [0, 2], keepdims=0)
    check(model, feeds, rtol=1e-5)


@pytest.mark.usefixtures("check_backend")
@pytest.mark.parametrize("opset", [13, 18, 21])
def test_split_squeeze_unsqueeze_pad_across_opsets(opset: int) -> None:
    nodes = [
        helper.make_node("Unsqueeze", ["x", "ax0"], ["u"]),
        helper.make_node("Squeeze", ["u", "ax0"], ["s"]),
        helper.make_node("Split", ["s", "sizes"], ["a", "b"], axis=2),
        helper.make_node("Pad", ["b", "pads", "pv"], ["p"]),
        helper.make_node("Clip", ["a", "lo", ""], ["c"]),
    ]
    inits = {
        "ax0": np.array([0], np.int64),
        "sizes": np.array([2, 3], np.int64),
        "pads": np.array([0, 1, 0, 0, 0, 1], np.int64),
        "pv": np.array(0.25, np.float32),
        "lo": np.array(-0.1, np.float32),
    }
    model = make_model(nodes, {"x": X}, ["p", "c"], inits, opset=opset)
    check(model, {"x": X})


@pytest.mark.parametrize("exponent", [2.0, 3.0, 0.5, -1.0, 1.5])
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_pow_constant_exponent_matches_onnxruntime_exactly(exponent, shape):
    """ONNX Runtime computes Pow by 2, 3, 0.5 and -1 as products, sqrt or a reciprocal;
    Ember does too: equal to the bit (other exponents: pow, within tolerance)."""
    x = np.abs(randn(4, 33)) * 10 + 0.5
    model = single("Pow", {"x": x}, initializers={"e": np.full(shape, exponent, np.float32)})
    (got,) = ember.compile_onnx(model)(x)
    (want,) = ort_run(model, {"x": x})
    assert got.shape == want.shape
    if exponent == 1.5:
        np.testing.assert_allclose(got, want, rtol=1e-6)
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    ("op", "x", "exact"),
    [
        ("Sinh", TINY, np.sinh),
        ("Asinh", TINY, np.arcsinh),
        ("Asinh", HUGE, np.arcsinh),
        ("Atanh", TINY, np.arctanh),
        ("Asin", UNIT, np.arcsin),
        ("Acosh", ABOVE_ONE, np.arccosh),
        ("Softplus", WIDE, np.logaddexp.reduce),
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_composed_functions_keep_relative_precision(
    op: str, x: np.ndarray, exact, backend: str
) -> None:
    """Relative error against float64 where the textbook formula would cancel or overflow
    (the ONNX Runtime comparison's absolute tolerance would hide that); also on the CUDA
    backend's generated code, run by its emulator."""
    (got,) = compile_on(single(op, {"x": x}), backend)(x=x)
    x64 = x.astype(np.float64)
    want = exact([np.zeros_like(x64), x64], axis=0) if op == "Softplus" else exact(x64)
    np.testing.assert_allclose(got, want, rtol=4e-6, atol=0)
