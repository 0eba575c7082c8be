"""topk (values and indices): k selection rounds for small k, a sort beyond (a large k is
in test_sort.py)."""

import pytest
import torch
from conftest import check, host_options, rand


@pytest.mark.parametrize(
    "k, dim, largest",
    [(1, -1, True), (2, -1, True), (3, 0, True), (4, 1, False), (6, -1, True), (2, 1, False)],
)
def test_topk(k, dim, largest, backend):
    # A permutation of distinct values: no ties, so indices are unambiguous.
    x = (torch.randperm(5 * 6 * 7).reshape(5, 6, 7).float() - 100) / 7
    check(lambda x: torch.topk(x, k, dim=dim, largest=largest), [x], backend)


def test_topk_of_ints_and_noncontiguous(backend):
    x = torch.randperm(48).reshape(6, 8) - 20
    check(lambda x: torch.topk(x.t(), 3, dim=0), [x], backend)
    check(lambda x: torch.topk(x, 2, largest=False), [x.to(torch.int32)], backend)


def test_topk_moe_router(backend):
    """The MoE routing pattern: softmax over experts, top-2, renormalized weights."""

    def route(logits):
        probs = logits.softmax(-1)
        weights, experts = probs.topk(2, dim=-1)
        return weights / weights.sum(-1, keepdim=True), experts

    check(route, [rand(9, 8)], backend)


def test_topk_with_nan_and_infinities(backend):
    """NaN ranks above everything (as in torch); -inf entries and ties are still picked once
    each. Ties may come in either order, so values are compared, and indices must point at
    them."""
    x = torch.tensor(
        [
            [1.0, float("nan"), 3.0, float("-inf"), 2.0],
            [float("-inf"), float("-inf"), 0.5, float("-inf"), float("-inf")],
            [4.0, 4.0, float("inf"), -1.0, 4.0],
        ]
    )
    options = host_options(backend)
    fn = torch.compile(lambda x: torch.topk(x, 4), backend="ember", options=options)
    with torch.no_grad():
        values, indices = fn(x)
    want, _ = torch.topk(x, 4)
    torch.testing.assert_close(values, want, equal_nan=True)
    torch.testing.assert_close(x.gather(1, indices), values, equal_nan=True)
    for row in indices:
        assert len(set(row.tolist())) == 4, f"an element was picked twice: {row}"


def test_topk_with_k_zero(backend):
    check(lambda x: torch.topk(x, 0, dim=1), [rand(3, 4)], backend)
