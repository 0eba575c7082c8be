"""torch.scatter / scatter_add / scatter_reduce against eager, on every backend."""

from __future__ import annotations

import pytest
import torch
from conftest import check, rand


def _unique_index(rows: int, cols: int, size: int, seed: int) -> torch.Tensor:
    """Per column, distinct rows in [0, size) (so plain scatter is well defined)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(size, generator=g)[:rows] for _ in range(cols)], dim=1)


def test_scatter_src_and_value(backend):
    def fn(x, idx, src):
        return x.scatter(0, idx, src), x.scatter(0, idx, 2.5)

    idx = _unique_index(3, 4, 6, seed=0)
    check(fn, [rand(6, 4), idx, rand(5, 4)], backend)


def test_scatter_along_the_last_dim(backend):
    def fn(x, idx, src):
        return torch.scatter(x, -1, idx, src)

    idx = _unique_index(5, 2, 7, seed=1).T.contiguous()
    check(fn, [rand(2, 7), idx, rand(2, 5)], backend)


def test_scatter_add_with_repeated_indices(backend):
    def fn(x, idx, src):
        return x.scatter_add(1, idx, src)

    idx = torch.tensor([[0, 0, 2, 2, 2], [1, 3, 1, 1, 0]])
    check(fn, [rand(2, 4), idx, rand(2, 5)], backend)


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("reduce", ["sum", "prod", "amax", "amin", "mean"])
def test_scatter_reduce(backend, reduce, include_self):
    """Without include_self the elements an index names start from the reduction's identity
    (a mean counts only the updates); the others keep self's value."""

    def fn(x, idx, src):
        return x.scatter_reduce(0, idx, src, reduce=reduce, include_self=include_self)

    idx = torch.tensor([[0, 1, 2], [0, 1, 2], [3, 0, 0]])
    check(fn, [rand(4, 3), idx, rand(3, 3)], backend, rtol=1e-5, atol=1e-5)


def test_scatter_add_integers(backend):
    def fn(x, idx, src):
        return x.scatter_add(0, idx, src)

    idx = torch.tensor([[0, 1], [0, 1], [2, 2]])
    x = torch.randint(-5, 5, (3, 2))
    check(fn, [x, idx, torch.randint(-5, 5, (3, 2))], backend)


@pytest.mark.parametrize("reduce", ["amax", "mean", "prod"])
def test_scatter_reduce_integers_without_self(backend, reduce):
    """An integer mean rounds down, as torch's does."""

    def fn(x, idx, src):
        return x.scatter_reduce(1, idx, src, reduce=reduce, include_self=False)

    idx = torch.tensor([[0, 0, 2], [1, 1, 1]])
    x = torch.randint(-9, 9, (2, 4))
    check(fn, [x, idx, torch.randint(-9, 9, (2, 3))], backend)
