"""Reductions with keepdim and several axes, values and indices, var/std, softmax."""

import pytest
import torch
from conftest import check, rand

REDUCTIONS = {
    "sum_all": lambda x: x.sum(),
    "sum_axes_keepdim": lambda x: x.sum(dim=(0, 2), keepdim=True),
    "mean_neg_axis": lambda x: x.mean(-1),
    "mean_axes": lambda x: x.mean(dim=(1, 2), keepdim=True),
    "prod": lambda x: x.prod(dim=1),
    "amax": lambda x: x.amax(dim=(0, 1)),
    "amin_keepdim": lambda x: x.amin(dim=2, keepdim=True),
    "max_all": lambda x: x.max(),
    "min_all": lambda x: x.min(),
    "max_dim": lambda x: x.max(dim=1),
    "min_dim_keepdim": lambda x: x.min(dim=-1, keepdim=True),
    "argmax": lambda x: x.argmax(dim=2),
    "argmin_keepdim": lambda x: x.argmin(dim=0, keepdim=True),
    "argmax_flat": lambda x: x.argmax(),
    "var": lambda x: x.var(dim=1),
    "var_unbiased_false": lambda x: x.var(dim=(0, 2), unbiased=False, keepdim=True),
    "std": lambda x: x.std(dim=-1),
    "std_correction": lambda x: torch.std(x, dim=1, correction=0),
}


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reduction(name, backend):
    x = rand(3, 5, 7, low=-2, high=2)
    check(REDUCTIONS[name], [x], backend, rtol=1e-5, new_inputs=[rand(3, 5, 7)])


def test_reduction_of_ints_and_bools(backend):
    def fn(i, b):
        return i.sum(dim=1), b.sum(), i.amax(dim=0), b.any(dim=1), b.all(), i.prod()

    check(
        fn, [rand(4, 5, dtype=torch.int32, low=-3, high=3), rand(4, 5, dtype=torch.bool)], backend
    )


def test_reduction_of_noncontiguous(backend):
    check(
        lambda x: (x.transpose(0, 2).sum(dim=1), x[:, ::2].amax(dim=-1)), [rand(4, 6, 5)], backend
    )


def test_reductions_over_middle_axes(backend):
    """Kept innermost dims that are contiguous and wide (the mixture-of-experts combine,
    sequence pooling) are reduced a row at a time: large and odd sizes, NaN, ints, bools,
    axes around the kept ones, a transposed input."""
    x = rand(8, 64, 520)
    x[0, 3, 5] = float("nan")

    def floats(x):
        return (
            x.sum(dim=1),
            x.amax(dim=1),
            x.mean(dim=(0, 1)),
            x[:3, :5].prod(dim=0),
            x.transpose(0, 1).amin(dim=0),
        )

    check(floats, [x], backend, rtol=1e-5)
    y = rand(2, 9, 6, 33, low=-5, high=5)
    check(lambda y: y.sum(dim=(0, 2), keepdim=True), [y], backend, rtol=1e-5)
    ints = rand(5, 7, 40, dtype=torch.int32, low=-9, high=9)
    bools = rand(5, 7, 40, dtype=torch.bool)
    check(lambda i, b: (i.sum(dim=1), i.amax(dim=0), b.any(dim=1)), [ints, bools], backend)


def test_long_reductions_to_few_outputs(backend):
    """A reduction of many elements into one or two outputs (a global max, as dynamic
    quantization takes) is split across threads and folded in vector lanes: NaN anywhere
    (here in a run's tail) still wins, sums and products stay exact enough, ints and bools
    too, strided inputs included."""
    x = rand(100_003, low=-2, high=2)
    y = rand(2, 70_001)
    y[1, 69_999] = float("nan")
    # In f64: eager's f32 product of 50k factors is itself off by ~1e-4.
    near_one = rand(50_001, low=0.9999, high=1.0001).double()
    check(
        lambda x, y, p: (x.amax(), x.amin(), x.sum(), x[::3].mean(), y.amax(dim=1), p.prod()),
        [x, y, near_one],
        backend,
        rtol=1e-5,
    )
    ints = rand(90_001, dtype=torch.int32, low=-9, high=9)
    bools = rand(90_001, dtype=torch.bool)
    check(lambda i, b: (i.sum(), i.amax(), i.amin(), b.any(), b.all()), [ints, bools], backend)


def test_argmax_ties_pick_first(backend):
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    check(lambda x: (x.argmax(dim=1), x.argmin(dim=1), x.max(dim=1)), [x], backend)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax_and_log_softmax(dim, backend):
    x = rand(4, 5, 6) * 30  # large magnitudes: the max must be subtracted
    check(lambda x: (torch.softmax(x, dim), torch.log_softmax(x, dim)), [x], backend, rtol=1e-5)


def test_softmax_large_values_and_f16(backend):
    x = torch.tensor([[1000.0, 1001.0, 999.0], [-1e4, 0.0, 1e4]])
    check(lambda x: torch.softmax(x, -1), [x], backend)
    torch._dynamo.reset()
    check(lambda x: torch.softmax(x, -1), [rand(3, 8, dtype=torch.float16)], backend)


def test_cumsum(backend):
    check(
        lambda x, i: (x.cumsum(1), i.cumsum(0)),
        [rand(3, 6), rand(5, dtype=torch.int32)],
        backend,
        rtol=1e-5,
    )


def test_cumprod_cummax_cummin(backend):
    """Running products, maxima and minima with their indices; ties move the index to the
    latest equal element and a NaN stays once seen, as in torch."""

    def fn(x, i, t):
        mx, mn = torch.cummax(x, 1), torch.cummin(t, 0)
        return torch.cumprod(x * 0.9, 1), i.cumprod(0), mx.values, mx.indices, mn, t.cummax(1)

    x = rand(3, 9)
    x[1, 4] = float("nan")
    ties = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, -1.0, -1.0, 5.0, -1.0]])
    check(fn, [x, rand(5, 2, dtype=torch.int32, low=-3, high=3), ties], backend, rtol=1e-5)


def test_cummax_of_ints_and_a_transposed_input(backend):
    def fn(i, x):
        return torch.cummax(i, -1), torch.cummin(x.transpose(0, 1), 1)

    check(fn, [rand(4, 6, dtype=torch.int64, low=-4, high=4), rand(5, 3)], backend)
