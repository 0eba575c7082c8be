"""embedding/index_select/gather/advanced indexing, tril/triu, and tensor creation."""

import ember
import pytest
import torch
import torch.nn.functional as F
from conftest import check, host_options, rand
from ember.backend import programs_compiled


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


def test_index_with_several_index_tensors(backend):
    """Broadcast index tensors, adjacent (result dims in place) and not (result dims first),
    negative indices, and the attention-mask pattern `mask[batch[:, None], positions]`."""
    i = torch.tensor([[0], [2], [-1]])
    j = torch.tensor([3, 0, -2, 1])
    check(
        lambda x, i, j: (x[i, j], x[:, i, j], x[i, :, j], x[-1, j], x[i, j, 1]),
        [rand(4, 5, 6), i, j],
        backend,
    )
    mask = torch.rand(3, 7) > 0.3
    batch, pos = torch.arange(3), torch.arange(7)
    check(
        lambda m, b, p: m[b[:, None, None, None], p[None, None, None, :]],
        [mask, batch, pos],
        backend,
    )


def test_index_with_several_index_tensors_out_of_range_raises(backend):
    """An index past its own dim is an error, even where the flattened position exists."""
    fn = torch.compile(lambda x, i, j: x[i, j], backend="ember", options=host_options(backend))
    x = rand(4, 5)
    with pytest.raises(ember.EmberError):
        fn(x, torch.tensor([1]), torch.tensor([5]))


def test_arange_with_symbolic_bounds(backend):
    """arange over sizes (positions of new tokens after a cache): one program for all sizes.
    (Each result uses the tensor: a graph with no tensor input carries its sizes as ints
    alone, and Ember, whose programs read sizes from tensor shapes, specializes it.)"""

    def fn(x):
        n = x.shape[0]
        return (
            torch.arange(n) + x,
            torch.arange(n, 2 * n + 1) + x.sum(),
            torch.arange(1, n, 2) * x.sum(),
            torch.arange(n, 0, -3, dtype=torch.float32) + x.amax(),
            torch.arange(n + 5) * x.mean(),
        )

    compiled = torch.compile(fn, backend="ember", dynamic=True, options=host_options(backend))
    before = programs_compiled()
    with torch.no_grad():
        # No result of length 0 or 1: Dynamo would guard on (and recompile for) those.
        for n in (9, 10, 14, 12, 17):
            x = rand(n)
            torch.testing.assert_close(compiled(x), fn(x))
    assert programs_compiled() - before == 1


def test_size_as_a_tensor_operand(backend):
    """`x + x.shape[0]`: a symbolic size used as a number."""

    def fn(x):
        return x * x.shape[-1] + x.shape[0], (x > 0).long() + x.shape[1]

    compiled = torch.compile(fn, backend="ember", dynamic=True, options=host_options(backend))
    before = programs_compiled()
    with torch.no_grad():
        for shape in ((2, 3), (5, 4), (3, 7)):
            x = rand(*shape)
            torch.testing.assert_close(compiled(x), fn(x))
    assert programs_compiled() - before == 1


def test_index_put_and_index_copy(backend):
    """Writes at index positions (a static KV cache's update), out of place and in place on
    a clone; negative indices; values broadcast."""

    def fn(cache, pos, new):
        a = torch.ops.aten.index_put.default(cache, [None, None, pos], new)
        b = cache.clone()
        b[:, :, pos] = new
        c = cache.index_copy(2, pos, new)
        d = cache.clone()
        d.index_copy_(2, pos, new)
        e = torch.index_put(cache, (torch.tensor([-1, 0]),), torch.tensor(2.5))
        f = torch.ops.aten.index_put.default(cache, [None, None, pos - 8], new)
        return a, b, c, d, e, f

    cache = rand(2, 3, 8, 4)
    check(fn, [cache, torch.tensor([5, 1, 6]), rand(2, 3, 3, 4)], backend)


def test_index_put_accumulate_adds_repeated_positions(backend):
    def fn(x, i, v):
        return x.index_put((i,), v, accumulate=True)

    check(fn, [rand(5, 2), torch.tensor([1, 1, -1]), rand(3, 2)], backend)


def test_index_put_with_several_index_tensors(backend):
    """x[i, j] = v and x[:, i, :, j] += v (non-adjacent dims: the broadcast index dims come
    first in the values' shape), as F.fold's decomposition writes."""

    def fn(x, i, j, v, w):
        a = torch.ops.aten.index_put.default(x, [i, j], v)
        b = torch.ops.aten.index_put.default(x, [None, i, None, j], w, True)
        c = x.clone()
        c[i[:1], -1] = 0.5
        return a, b, c

    i, j = torch.tensor([0, 2, 1]), torch.tensor([[1], [3]])
    check(fn, [rand(3, 4, 2, 5), i, j, rand(2, 3, 2, 5), rand(2, 3, 3, 2)], backend)


def test_fold_of_unfold(backend):
    def fn(x):
        cols = F.unfold(x, 3, padding=1, stride=2)
        return F.fold(cols * 2, (7, 6), 3, padding=1, stride=2)

    check(fn, [rand(2, 3, 7, 6)], backend, rtol=1e-5)


def test_index_copy_out_of_range_raises():
    fn = torch.compile(
        lambda x, i, v: x.index_copy(0, i, v), backend="ember", options={"fallback": "error"}
    )
    with pytest.raises(ember.EmberError, match="out of range"):
        fn(rand(5, 2), torch.tensor([1, 7]), rand(2, 2))


def test_writes_into_slices_of_fresh_tensors(backend):
    """In-place writes into a new tensor (BEiT's relative position table) functionalize to
    `slice_scatter`, `select_scatter` and `copy`: values broadcast and cast, negative and
    open bounds, writes that overlap earlier ones."""

    def fn(x, i):
        t = torch.zeros(5, 6)
        t[1:, 2:4] = x[:4, :2]
        t[0] = x[0, 3]  # one value broadcast along a selected row
        t[:, -1] = 7.0
        t[-2:, :] = x[1]  # overlaps the first write, broadcast over rows
        u = torch.zeros(3, 4, dtype=torch.long)
        u[1:, 1:] = i  # int source into an int table
        u[0, :] = 2
        v = torch.empty(2, 6)
        v.copy_(x[:2] * 2)
        return t * 2, u + 1, v

    check(fn, [rand(5, 6), torch.arange(6).reshape(2, 3)], backend)


def test_strided_slice_writes_are_named():
    def fn(x):
        t = torch.zeros(6, 4)
        t[::2] = x
        return t

    compiled = torch.compile(fn, backend="ember", options={"fallback": "error"})
    with pytest.raises(ember.UnsupportedOpError, match="slice_scatter.*step 2"):
        compiled(rand(3, 4))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag(mode, backend):
    """nn.EmbeddingBag over flat indices with offsets (an empty bag in the middle and one at
    the end give zeros), and over 2-D indices (one bag per row), against eager."""
    table = torch.nn.EmbeddingBag(12, 5, mode=mode)

    def fn(flat, offsets, rows):
        return table(flat, offsets), table(rows)

    flat = torch.tensor([3, 1, 1, 7, 11, 0, 4])
    offsets = torch.tensor([0, 2, 2, 5, 7])
    check(fn, [flat, offsets, torch.randint(0, 12, (3, 4))], backend)


def test_embedding_bag_weights_padding_and_last_offset(backend):
    """per_sample_weights (sum), padding_idx rows left out (and not counted by a mean),
    include_last_offset."""
    weighted = torch.nn.EmbeddingBag(10, 4, mode="sum", include_last_offset=True)
    padded = torch.nn.EmbeddingBag(10, 4, mode="mean", padding_idx=2)

    def fn(flat, offsets, psw):
        return weighted(flat, offsets, per_sample_weights=psw), padded(flat, offsets[:-1])

    flat = torch.tensor([2, 5, 2, 9, 0, 2, 2])
    check(fn, [flat, torch.tensor([0, 3, 5, 7]), rand(7)], backend, rtol=1e-5)
