"""sort and argsort (an `Argsort` op: stable, NaN above every number), topk beyond a few
rounds of selection, histc, bucketize and searchsorted, and the grouped matrix products of
mixture-of-experts layers."""

import ember
import pytest
import torch
from conftest import Fn, check, rand


def _distinct(*shape: int) -> torch.Tensor:
    """Distinct values: indices are unambiguous whatever the sort's stability."""
    n = 1
    for s in shape:
        n *= s
    return (torch.randperm(n).reshape(shape).float() - n / 2) / 7


@pytest.mark.parametrize("dim", [-1, 0, 1])
@pytest.mark.parametrize("descending", [False, True])
def test_sort(dim, descending, backend):
    check(
        lambda x: torch.sort(x, dim=dim, descending=descending),
        [_distinct(4, 9, 5)],
        backend,
        new_inputs=[_distinct(4, 9, 5)],
    )


@pytest.mark.parametrize("descending", [False, True])
def test_stable_sort_keeps_ties_in_order(descending, backend):
    """Many ties, NaNs, infinities and signed zeros: a stable sort has one right answer."""
    x = rand(6, 40, dtype=torch.int64, low=-3, high=3).float()
    x[0, :8] = torch.tensor([float("nan"), 1.0, float("nan"), -0.0, 0.0, float("inf"), 2, -2])
    x[1, :4] = float("-inf")
    check(lambda x: torch.sort(x, stable=True, descending=descending), [x], backend)
    check(lambda x: torch.argsort(x, dim=0, stable=True, descending=descending), [x], backend)


def test_argsort_of_ints_bools_and_transposed_inputs(backend):
    ints = rand(7, 33, dtype=torch.int32, low=-50, high=50)
    check(lambda x: torch.argsort(x.t(), dim=0, stable=True), [ints], backend)
    bools = rand(3, 17, dtype=torch.bool)
    check(lambda x: torch.sort(x, stable=True, descending=True), [bools], backend)
    check(lambda x: torch.sort(x, dim=0), [torch.tensor(2.5)], backend)


def test_sorted_values_feed_later_ops(backend):
    """A median-like use: the sort's values are sliced and combined."""

    def middle(x):
        values, order = x.sort(dim=-1)
        return values[..., 3:-3].mean(-1) + order[..., :2].float().sum(-1)

    check(middle, [_distinct(5, 16)], backend)


@pytest.mark.parametrize("largest", [True, False])
def test_topk_with_a_large_k(largest, backend):
    check(lambda x: torch.topk(x, 65, largest=largest), [_distinct(3, 100)], backend)


def test_histc(backend):
    x = rand(5, 40, low=-4, high=4)
    check(lambda x: torch.histc(x, bins=7), [x], backend)  # the data's range
    x[0, :3] = torch.tensor([float("nan"), 3.0, -3.0])  # NaN skipped; edges count
    check(lambda x: torch.histc(x, bins=12, min=-3, max=3), [x], backend)


def test_histc_of_one_value_and_of_expert_ids(backend):
    check(lambda x: torch.histc(x, bins=3), [torch.full((4,), 2.0)], backend)
    # The MoE use: tokens per expert from sorted expert ids.
    ids = rand(24, dtype=torch.int64, low=0, high=7).sort().values.float()
    check(lambda x: torch.histc(x, bins=8, min=0, max=7), [ids], backend)


def _needs_eager_grouped_mm(backend: str) -> None:
    """On the GPU the reference is eager `grouped_mm` there, which some GPUs and dtypes lack."""
    if backend != "cuda":
        return
    try:
        torch.nn.functional.grouped_mm(
            torch.zeros(4, 8, device="cuda", dtype=torch.bfloat16),
            torch.zeros(2, 8, 8, device="cuda", dtype=torch.bfloat16),
            offs=torch.tensor([2, 4], dtype=torch.int32, device="cuda"),
        )
    except RuntimeError as e:
        pytest.skip(f"eager grouped_mm does not run on this GPU: {e}")


def _grouped(backend: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """`tensors` in the type `grouped_mm` takes on `backend`: torch's CUDA kernel, and the
    fake kernel Dynamo traces it with, take bf16 only."""
    if backend != "cuda":
        return list(tensors)
    return [t.to(torch.bfloat16) if t.is_floating_point() else t for t in tensors]


# bf16 products on the GPU: each output rounds to 8 bits of mantissa, and the two sides may
# sum in different orders before rounding.
GROUPED_BF16_TOL = {"rtol": 1.6e-2, "atol": 1e-2}


def _grouped_tol(backend: str, **tol: float) -> dict[str, float]:
    return GROUPED_BF16_TOL if backend == "cuda" else tol


def _offsets(rows: int, groups: int, last: int | None = None) -> torch.Tensor:
    """Cumulative group ends, one group empty, ending at `last` (default: every row)."""
    cuts = torch.randint(0, (last if last is not None else rows) + 1, (groups - 1,)).sort().values
    cuts[1] = cuts[0]  # an empty group
    end = torch.tensor([last if last is not None else rows])
    return torch.cat([cuts, end]).to(torch.int32)


def test_grouped_mm(backend):
    _needs_eager_grouped_mm(backend)
    n = 16 if backend == "cuda" else 12  # bf16 rows of 16-byte multiples, as torch asks
    check(
        lambda x, w, offs: torch.nn.functional.grouped_mm(x, w, offs=offs),
        [*_grouped(backend, rand(20, 8), rand(4, 8, n)), _offsets(20, 4)],
        backend,
        new_inputs=[*_grouped(backend, rand(20, 8), rand(4, 8, n)), _offsets(20, 4)],
        **_grouped_tol(backend),
    )


def test_grouped_mm_of_transposed_expert_weights(backend):
    """Experts stored [G, N, K] (as Mixtral's) multiply through a transposed view."""
    _needs_eager_grouped_mm(backend)

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(rand(3, 16, 8))

        def forward(self, x, offs):
            return torch.nn.functional.grouped_mm(x, self.weight.transpose(-2, -1), offs=offs)

    experts = Experts().to(_grouped(backend, rand(1))[0].dtype)
    check(
        experts,
        [*_grouped(backend, rand(10, 8)), _offsets(10, 3)],
        backend,
        **_grouped_tol(backend),
    )


def test_transformers_grouped_mm_fallback_zeroes_rows_past_the_last_offset(backend):
    pytest.importorskip("transformers.integrations.moe")

    def experts(x, w, offs):
        return torch.ops.transformers.grouped_mm_fallback(x, w, offs=offs)

    check(experts, [rand(9, 6), rand(3, 6, 5), _offsets(9, 3, last=7)], backend)


def test_grouped_mm_clamps_bad_offsets(backend):
    """Offsets past the rows, negative or decreasing (undefined in torch) neither crash nor
    read out of bounds: each end is clamped into [previous end, rows]."""
    if backend == "cuda":
        pytest.skip("host tensors")

    def reference(x, w, offs):
        out, start = torch.zeros(x.shape[0], w.shape[2]), 0
        for g, end in enumerate(offs.tolist()):
            end = max(start, min(max(end, 0), x.shape[0]))
            out[start:end] = x[start:end] @ w[g]
            start = end
        return out

    x, w = rand(8, 4), rand(4, 4, 8)
    compiled = ember.compile(
        Fn(lambda x, w, offs: torch.nn.functional.grouped_mm(x, w, offs=offs)),
        x,
        w,
        torch.tensor([2, 4, 6, 8], dtype=torch.int32),
        backend=backend,
    )
    for offs in ([3, 1, 6, 99], [-5, 2, 2, 5], [9, 9, 9, 9]):
        offs = torch.tensor(offs, dtype=torch.int32)
        torch.testing.assert_close(compiled(x, w, offs), reference(x, w, offs))


@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_mm_of_a_decoded_token(transposed, backend):
    """Groups of one to three rows and experts large enough to split across threads: the
    few-row paths (dot products over a contiguous K, or summed rows of w)."""
    _needs_eager_grouped_mm(backend)

    def experts(x, w, offs):
        w = w.transpose(-2, -1) if transposed else w
        return torch.nn.functional.grouped_mm(x, w, offs=offs)

    n = 304 if backend == "cuda" else 300  # bf16 rows of 16-byte multiples, as torch asks
    w = rand(3, n, 256) if transposed else rand(3, 256, n)
    offs = torch.tensor([1, 1, 4], dtype=torch.int32)
    x, w = _grouped(backend, rand(4, 256), w)
    check(experts, [x, w, offs], backend, **_grouped_tol(backend, rtol=1e-5, atol=1e-4))


@pytest.mark.parametrize("right", [False, True])
def test_bucketize_and_searchsorted(right, backend):
    # Values on the edges themselves (where `right` decides), past both ends, and NaN
    # (torch puts it past the end).
    edges = torch.tensor([-1.0, 0.0, 0.5, 2.0])
    rows = torch.tensor([[-2.0, -1.0, 3.0], [0.0, 0.25, 0.5]])

    def fn(x, y):
        return (
            torch.bucketize(x, edges, right=right),
            torch.bucketize(x, edges, right=right, out_int32=True),
            torch.searchsorted(edges, x, right=right),
            torch.searchsorted(rows, y, side="right" if right else "left"),
        )

    x = torch.tensor([[-3.0, -1.0, 0.0, 0.2], [0.5, 2.0, 5.0, float("nan")]])
    check(fn, [x, rand(2, 5, low=-3, high=4)], backend, new_inputs=[rand(2, 4), rand(2, 5)])


def test_searchsorted_with_a_sorter_is_named():
    def fn(seq, x):
        return torch.searchsorted(seq, x, sorter=torch.argsort(seq))

    with pytest.raises(ember.UnsupportedOpError, match="sorter"):
        ember.compile(Fn(fn), rand(6), rand(3), fallback="error")


@pytest.mark.parametrize("keepdim", [False, True])
def test_median_nanmedian_and_kthvalue(keepdim, backend):
    """Order statistics along a dim: the lower median, the k-th smallest and their indices;
    median returns the first NaN of a line that has one, nanmedian skips NaNs. (Of a line
    all NaN, nanmedian's index is whichever torch's nth_element leaves: not compared.)"""

    def fn(x, i):
        return (
            x.median(1, keepdim=keepdim),
            x.nanmedian(0, keepdim=keepdim),
            x.kthvalue(3, 1, keepdim=keepdim),
            x.median(),
            x.nanmedian(),
            i.median(0, keepdim=keepdim),
            i.kthvalue(1, 0, keepdim=keepdim),
        )

    x = rand(5, 8)
    x[1, 2] = x[1, 6] = x[3, 0] = float("nan")
    x[:4, 7] = float("nan")
    check(fn, [x, torch.randperm(30).reshape(6, 5).to(torch.int32)], backend)


def test_median_of_an_even_count_without_nans(backend):
    check(lambda x: (torch.median(x, -1), x.median()), [rand(4, 6)], backend)
