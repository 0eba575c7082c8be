"""embedding/index_select/gather/advanced indexing, tril/triu, and tensor creation."""

import torch
import torch.nn.functional as F
from conftest import check, rand


def test_embedding(backend):
    table = rand(10, 4)
    check(lambda i: F.embedding(i, table), [torch.tensor([[1, 0, 9], [3, 3, 2]])], backend)


def test_index_select_and_negative_indices(backend):
    check(
        lambda x, i, j: (x.index_select(1, i), x[:, i], x[i], x[j], x[:, j]),
        [rand(5, 6), torch.tensor([4, 0, 2, 2]), torch.tensor([-1, 0, -5])],
        backend,
    )


def test_gather(backend):
    idx = torch.tensor([[0, 2, 1], [1, 1, 0]])
    check(lambda x, i: torch.gather(x, 1, i), [rand(2, 4), idx], backend)


def test_tril_triu(backend):
    check(lambda x: (torch.tril(x), torch.triu(x, 1), torch.tril(x, -1)), [rand(2, 4, 5)], backend)


def test_creation_ops(backend):
    def fn(x):
        return (
            x + torch.arange(5),
            torch.arange(2, 11, 3) * 1,
            torch.arange(0.0, 1.0, 0.25) + 0,
            torch.full((2, 5), 7.5) + x,
            torch.zeros(5) + x,
            torch.ones(2, 1, dtype=torch.int64) * 3,
            torch.zeros_like(x) + 1,
            torch.ones_like(x, dtype=torch.int32),
            torch.full_like(x, -2.0),
            x + torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]),
        )

    check(fn, [rand(2, 5)], backend)


def test_causal_mask_construction(backend):
    def fn(x):
        n = x.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        return x.masked_fill(~mask, float("-inf")).softmax(-1)

    check(fn, [rand(2, 6, 6)], backend)
