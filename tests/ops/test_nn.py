"""layer_norm, rms_norm and scaled_dot_product_attention (causal, boolean and additive
masks, explicit scale, grouped-query heads)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import check, rand

TOL = {"rtol": 1e-5, "atol": 1e-5}


def test_layer_norm(backend):
    w, b = rand(6), rand(6)
    check(
        lambda x: (F.layer_norm(x, (6,), w, b), F.layer_norm(x, (6,)), F.layer_norm(x, (4, 6))),
        [rand(3, 4, 6) * 50 + 100],  # a large mean must not cost precision
        backend,
        **TOL,
    )


def test_rms_norm(backend):
    w = rand(8)
    check(
        lambda x: (F.rms_norm(x, (8,), w, 1e-6), F.rms_norm(x, (8,))),
        [rand(2, 5, 8) * 100],
        backend,
        **TOL,
    )


def test_row_wise_kernels_overwrite_reused_buffers(backend):
    """Softmax over the last axis, log-softmax, layer norm and RMS norm write into buffers
    reused from the previous call (or into the caller's output): the second call, on new
    values, must overwrite every element."""
    w, b = rand(33), rand(33)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.layer_norm(x, (33,), w, b)
        s = torch.softmax(h * 2, dim=-1) + torch.softmax(h, dim=0)
        return F.rms_norm(s + x, (33,), w), torch.log_softmax(x, dim=-1)

    check(f, [rand(7, 33) * 3 + 10], backend, new_inputs=[rand(7, 33) - 5], **TOL)


def test_layer_norm_module_noncontiguous(backend):
    ln = torch.nn.LayerNorm(5)
    check(lambda x: ln(x.transpose(1, 2)), [rand(2, 5, 3)], backend, **TOL)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa(causal, backend):
    q, k, v = rand(2, 3, 5, 8), rand(2, 3, 5, 8), rand(2, 3, 5, 8)
    check(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        [q, k, v],
        backend,
        **TOL,
    )


def test_sdpa_masks_and_scale(backend):
    q, k, v = rand(2, 2, 4, 8), rand(2, 2, 6, 8), rand(2, 2, 6, 3)
    keep = torch.rand(4, 6) > 0.3
    keep[:, 0] = True  # no fully masked rows
    bias = rand(2, 1, 4, 6)

    def fn(q, k, v):
        return (
            F.scaled_dot_product_attention(q, k, v, attn_mask=keep),
            F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
            F.scaled_dot_product_attention(q, k, v, scale=0.3),
        )

    check(fn, [q, k, v], backend, **TOL)


@pytest.mark.parametrize("queries", [2, 12])
def test_sdpa_fully_masked_rows_give_zeros(queries, backend):
    """Left padding masks every key of some query rows: torch's SDPA gives zeros there (a
    plain softmax would give NaN); Ember must too, for bool and -inf masks, on the direct
    (few rows) and GEMM (many rows) paths, and with causal masking on top."""
    q, k, v = rand(2, 2, queries, 8), rand(2, 2, queries, 8), rand(2, 2, queries, 5)
    keep = torch.rand(2, 1, queries, queries) > 0.3
    keep[..., 0] = True
    keep[0, :, 0, :] = False  # every key of query 0 of batch 0
    keep[1, :, -1, :] = False
    bias = torch.zeros(2, 1, queries, queries).masked_fill(~keep, float("-inf"))

    def fn(q, k, v):
        return (
            F.scaled_dot_product_attention(q, k, v, attn_mask=keep),
            F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
            F.scaled_dot_product_attention(q, k, v, attn_mask=keep[..., :1, :].expand_as(keep)),
        )

    with torch.no_grad():
        expected = fn(q, k, v)
    assert all(torch.isfinite(t).all() for t in expected)
    check(fn, [q, k, v], backend, **TOL)


def test_sdpa_grouped_query(backend):
    q, k, v = rand(1, 8, 5, 16), rand(1, 2, 5, 16), rand(1, 2, 5, 16)
    check(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        [q, k, v],
        backend,
        **TOL,
    )


@pytest.mark.parametrize("queries", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("keys_transposed", [False, True])
@pytest.mark.parametrize("dims", [(13, 7), (40, 41)])
def test_sdpa_few_and_many_query_rows(queries, keys_transposed, dims, backend):
    """Up to 8 query rows take the direct (decode) kernel, more take two GEMMs; keys stored
    transposed (not unit-stride along the head dim) always take the GEMMs. Head sizes leave
    tails after the 16-, 8- and 32-wide vector blocks; large scores test the softmax's max
    shift."""
    e, ev = dims
    q, v = rand(2, 3, queries, e) * 8, rand(2, 3, 37, ev)
    k = rand(2, 3, e, 37).transpose(-1, -2) if keys_transposed else rand(2, 3, 37, e)
    keep = torch.rand(queries, 37) > 0.2
    keep[:, 0] = True

    def fn(q, k, v):
        return (
            F.scaled_dot_product_attention(q, k, v),
            F.scaled_dot_product_attention(q, k, v, attn_mask=keep),
            F.scaled_dot_product_attention(q, k, v, is_causal=True),
        )

    if queries == 3 and not keys_transposed:  # the generic (non-f32) loops of the kernel
        check(fn, [q.double(), k.double(), v.double()], backend, rtol=1e-9, atol=1e-9)
    # Scores reach ~40 here: their f32 rounding alone (~40 * 6e-8) moves the weights by ~1e-5.
    check(fn, [q, k, v], backend, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("queries", "keys"), [(130, 150), (130, 50), (70, 70)])
def test_sdpa_long_sequences_in_query_blocks(queries, keys, backend):
    """Long sequences run in blocks of query rows (64 on the CPU): a causal block reads only
    the keys its rows see, query heads sharing a key/value head share its packed keys, and
    masks and fully masked rows land in later blocks too."""
    q = rand(1, 4, queries, 24) * 3
    k, v = rand(1, 2, keys, 24), rand(1, 2, keys, 20)
    keep = torch.rand(1, 1, queries, keys) > 0.3
    keep[..., 0] = True
    keep[..., queries - 3, :] = False  # a fully masked row in the last block
    bias = torch.zeros(1, 1, queries, keys).masked_fill(~keep, float("-inf")) + rand(queries, keys)

    def fn(q, k, v):
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        k_strided = k.transpose(-1, -2).contiguous().transpose(-1, -2)
        return (
            F.scaled_dot_product_attention(q, k, v, is_causal=True),
            F.scaled_dot_product_attention(q, k, v, attn_mask=keep),
            F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
            F.scaled_dot_product_attention(q, k_strided, v),
        )

    check(fn, [q, k, v], backend, rtol=1e-4, atol=1e-4)
    if queries == 70:  # the generic (f64) loops
        check(fn, [q.double(), k.double(), v.double()], backend, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("keys", [1, 128, 300])
def test_sdpa_one_query_row_over_a_long_cache(keys, backend):
    """One query row per head, as in a decode step: the CUDA backend splits the keys into
    chunks of 128 and combines the chunks' partial results. A mask hides whole chunks (a
    chunk with no visible key must add nothing), one head sees no key at all (zeros, as
    torch), and causal masking lets the single row see only the first key."""
    q, k, v = rand(1, 4, 1, 16) * 4, rand(1, 4, keys, 16), rand(1, 4, keys, 24)
    keep = torch.rand(1, 4, 1, keys) > 0.3
    keep[..., : min(keys - 1, 130)] = False
    keep[..., -1] = True
    keep[0, 1] = False
    bias = torch.zeros(1, 4, 1, keys).masked_fill(~keep, float("-inf"))

    def fn(q, k, v):
        return (
            F.scaled_dot_product_attention(q, k, v),
            F.scaled_dot_product_attention(q, k, v, attn_mask=keep),
            F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
            F.scaled_dot_product_attention(q, k, v, is_causal=True),
        )

    with torch.no_grad():
        expected = fn(q, k, v)
    assert all(torch.isfinite(t).all() for t in expected)
    # A second call with new values: the count of each row's finished chunks starts again.
    again = [rand(*t.shape) for t in (q, k, v)]
    check(fn, [q, k, v], backend, rtol=1e-4, atol=1e-4, new_inputs=again)


def test_batch_norm_eval(backend):
    bn = torch.nn.BatchNorm1d(4).eval()
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    check(bn, [rand(3, 4, 5)], backend, **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_half_precision(dtype, backend):
    """f16/bf16 attention: on CUDA (and its emulator) the tensor-core kernel wherever the
    head dims are multiples of 16 (queries, keys) and 8 (values) — here with grouped-query
    heads, causal limits, boolean and additive masks and a fully masked row, over 40 rows
    (two and a half warps' 16) and 45 keys (a 32-key tile and part of another) — and the
    other kernels where they are not (head dim 24). Probabilities are rounded to the
    operands' type before the values' product, as flash attention rounds them."""
    q = (rand(1, 4, 40, 32) * 2).to(dtype)
    k, v = rand(1, 2, 45, 32).to(dtype), rand(1, 2, 45, 16).to(dtype)
    q24, k24 = rand(1, 2, 40, 24).to(dtype), rand(1, 2, 45, 24).to(dtype)
    keep = torch.rand(1, 1, 40, 45) > 0.3
    keep[..., 0] = True
    keep[..., 7, :] = False
    bias = torch.zeros(1, 1, 40, 45).masked_fill(~keep, float("-inf")).to(dtype)

    def fn(q, k, v, q24, k24):
        kg, vg = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        return (
            F.scaled_dot_product_attention(q, kg, vg, is_causal=True),
            F.scaled_dot_product_attention(q, kg, vg, attn_mask=keep),
            F.scaled_dot_product_attention(q, kg, vg, attn_mask=bias),
            F.scaled_dot_product_attention(q24, k24, v),
        )

    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    check(fn, [q, k, v, q24, k24], backend, rtol=tol, atol=tol)
