"""ONNX ScatterElements and ScatterND against ONNX Runtime: axes, negative indices, every
reduction, and out-of-range indices refused at run time."""

from __future__ import annotations

import ember
import numpy as np
import pytest
from onnx_util import check, randn, rng, single

REDUCTIONS = ["none", "add", "mul", "max", "min"]


def unique_rows(n: int, size: int, seed: int = 0) -> np.ndarray:
    """`n` distinct indices in [-size, size) (no two updates land on one element, so
    `none` is well defined)."""
    picked = rng(seed).permutation(size)[:n]
    return np.where(rng(seed + 1).random(n) < 0.3, picked - size, picked).astype(np.int64)


@pytest.mark.usefixtures("check_backend")
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_scatter_elements(axis, reduction):
    x = randn(6, 5)
    ax = axis % 2
    n_upd = 4
    cols = [unique_rows(n_upd, x.shape[ax], seed=c) for c in range(3)]
    idx = np.stack(cols, axis=1 - ax) if ax == 0 else np.stack(cols, axis=0)
    upd = randn(*idx.shape, seed=3)
    model = single(
        "ScatterElements",
        {"x": x, "i": idx, "u": upd},
        {"axis": axis, "reduction": reduction},
    )
    check(model, {"x": x, "i": idx, "u": upd})


@pytest.mark.usefixtures("check_backend")
@pytest.mark.parametrize("reduction", ["add", "mul", "max", "min"])
def test_scatter_elements_with_repeated_indices_combines_all(reduction):
    x = randn(4, 3)
    idx = np.array([[0, 1, 2], [0, 1, 2], [3, 3, 0]], dtype=np.int64)
    upd = randn(3, 3, seed=1)
    model = single("ScatterElements", {"x": x, "i": idx, "u": upd}, {"reduction": reduction})
    check(model, {"x": x, "i": idx, "u": upd})


@pytest.mark.usefixtures("check_backend")
def test_scatter_elements_of_integers():
    x = rng(0).integers(-9, 9, size=(3, 7)).astype(np.int64)
    idx = np.stack([unique_rows(5, 7, seed=s) for s in range(3)])
    upd = rng(5).integers(-9, 9, size=idx.shape).astype(np.int64)
    model = single("ScatterElements", {"x": x, "i": idx, "u": upd}, {"axis": 1, "reduction": "add"})
    check(model, {"x": x, "i": idx, "u": upd})


@pytest.mark.usefixtures("check_backend")
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_scatter_nd_rows(reduction):
    x = randn(5, 4, 3)
    idx = np.array([[[0, 1], [4, 3]], [[-1, 0], [2, 2]]], dtype=np.int64)  # [2, 2, k=2]
    upd = randn(2, 2, 3, seed=1)
    model = single("ScatterND", {"x": x, "i": idx, "u": upd}, {"reduction": reduction})
    check(model, {"x": x, "i": idx, "u": upd})


@pytest.mark.usefixtures("check_backend")
def test_scatter_nd_whole_slices_and_single_elements():
    x = randn(4, 5)
    idx = np.array([[3], [0]], dtype=np.int64)
    upd = randn(2, 5, seed=2)
    check(single("ScatterND", {"x": x, "i": idx, "u": upd}), {"x": x, "i": idx, "u": upd})
    idx = np.array([[3, 4], [0, 0], [1, 2]], dtype=np.int64)
    upd = randn(3, seed=3)
    check(single("ScatterND", {"x": x, "i": idx, "u": upd}), {"x": x, "i": idx, "u": upd})


def test_scatter_index_out_of_range_is_an_error_not_a_write():
    x = randn(3, 4)
    upd = randn(1, 4)
    model = single("ScatterElements", {"x": x, "i": np.zeros((1, 4), np.int64), "u": upd})
    runner = ember.compile_onnx(model)
    with pytest.raises(ember.EmberError, match="out of range"):
        runner(x=x, i=np.full((1, 4), 3, np.int64), u=upd)
    nd = single("ScatterND", {"x": x, "i": np.zeros((1, 1), np.int64), "u": upd})
    runner = ember.compile_onnx(nd)
    with pytest.raises(ember.EmberError, match="out of range"):
        runner(x=x, i=np.array([[5]], np.int64), u=upd)
