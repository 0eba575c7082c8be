"""ONNX TopK against ONNX Runtime: axes, largest/smallest, ties, integers, a large K (a
sort rather than selection rounds)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_util import check, randn, rng, single


@pytest.mark.usefixtures("check_backend")
@pytest.mark.parametrize("largest", [1, 0])
@pytest.mark.parametrize(("axis", "k"), [(-1, 3), (0, 2), (1, 1)])
def test_topk(axis, k, largest):
    x = randn(4, 6, 5)
    model = single(
        "TopK", {"x": x}, {"axis": axis, "largest": largest}, 2, {"k": np.array([k], np.int64)}
    )
    check(model, {"x": x})


@pytest.mark.usefixtures("check_backend")
def test_topk_ties_go_to_the_lower_index_and_integers_work():
    x = rng(0).integers(0, 4, size=(3, 9)).astype(np.int64)
    model = single("TopK", {"x": x}, {}, 2, {"k": np.array([4], np.int64)})
    check(model, {"x": x})


@pytest.mark.usefixtures("check_backend")
@pytest.mark.parametrize("largest", [1, 0])
def test_topk_with_a_large_k(largest):
    x = randn(2, 100)
    model = single("TopK", {"x": x}, {"largest": largest}, 2, {"k": np.array([80], np.int64)})
    check(model, {"x": x})


@pytest.mark.usefixtures("check_backend")
def test_topk_with_k_zero_gives_empty_outputs():
    x = randn(3, 7)
    model = single("TopK", {"x": x}, {}, 2, {"k": np.array([0], np.int64)})
    check(model, {"x": x})
