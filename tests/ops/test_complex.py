"""Complex tensors inside a graph (held as (real, imaginary) pairs): the rotary embeddings
LLaMA's reference code and SAM 2 write with complex numbers, complex arithmetic and the
shape ops around it, against eager."""

from __future__ import annotations

import ember
import pytest
import torch
from conftest import check, rand


def _freqs(dim: int, length: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    return torch.outer(torch.arange(length).float(), inv)


class LlamaRope(torch.nn.Module):
    """LLaMA's reference `apply_rotary_emb`: a complex buffer sliced to the sequence."""

    def __init__(self, head_dim: int = 16, max_len: int = 32) -> None:
        super().__init__()
        freqs = _freqs(head_dim, max_len)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(freqs), freqs))

    def forward(self, xq: torch.Tensor, xk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq = xq.shape[1]
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        freqs = self.freqs_cis[:seq].view(1, seq, 1, xq_.shape[-1])
        xq_out = torch.view_as_real(xq_ * freqs).flatten(3)
        xk_out = torch.view_as_real(xk_ * freqs).flatten(3)
        return xq_out.type_as(xq), xk_out.type_as(xk)


def test_llama_rotary_embedding(backend):
    check(LlamaRope(), [rand(2, 5, 4, 16), rand(2, 5, 2, 16)], backend, rtol=1e-5, atol=1e-5)


def test_llama_rotary_embedding_through_export():
    model = LlamaRope()
    xq, xk = rand(2, 7, 4, 16), rand(2, 7, 2, 16)
    compiled = ember.compile(model, xq, xk, quiet=True, fallback="error")
    for got, want in zip(compiled(xq, xk), model(xq, xk), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sam2_axial_rotary_embedding(backend):
    """SAM 2's `compute_axial_cis` (polar in the graph, a cat of complex tensors) and
    `apply_rotary_enc` with keys that repeat the frequencies."""

    def fn(xq, xk, t):
        fx = torch.outer(t[:, 0], torch.linspace(0.1, 1.0, 4))
        fy = torch.outer(t[:, 1], torch.linspace(0.2, 0.9, 4))
        cis = torch.cat(
            [torch.polar(torch.ones_like(fx), fx), torch.polar(torch.ones_like(fy), fy)], dim=-1
        )
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        cis_q = cis.view(1, 1, *cis.shape)
        cis_k = cis_q.repeat(1, 1, 2, 1)
        q = torch.view_as_real(xq_ * cis_q).flatten(3)
        k = torch.view_as_real(xk_ * cis_k).flatten(3)
        return q, k

    t = torch.stack(torch.meshgrid(torch.arange(3.0), torch.arange(2.0), indexing="ij"), -1)
    check(fn, [rand(2, 3, 6, 16), rand(2, 3, 12, 16), t.reshape(6, 2)], backend, rtol=1e-5)


def test_complex_arithmetic_and_parts(backend):
    """mul, div, add, sub (with alpha) of complex by complex, real tensor and scalar;
    conj, abs, real and imag."""

    def fn(a, b, r):
        z = torch.complex(a[..., 0], a[..., 1])
        w = torch.view_as_complex(b)
        out = [
            z * w,
            z / w,
            torch.add(z, w, alpha=2.0),
            z - w,
            z * r,
            z / r,
            z + r,
            r - z,
            2.0 - z,
            z * 1.5,
            z.conj() * w,
            -z,
        ]
        parts = [z.abs(), (z * w).real, (z / w).imag, z.conj().imag]
        return [torch.view_as_real(v) for v in out] + parts

    check(fn, [rand(3, 4, 2), rand(3, 4, 2), rand(3, 4, low=0.5, high=2.0)], backend, rtol=1e-5)


def test_shape_ops_on_complex_tensors(backend):
    def fn(a, b):
        z = torch.view_as_complex(a)
        w = torch.view_as_complex(b)
        t = z.transpose(0, 1)
        p = z.permute(1, 0, 2)
        u = z.unsqueeze(-1).expand(2, 3, 4, 2)
        c = torch.cat([z, w], dim=-1)
        s = torch.stack([z, w], dim=-1)
        f = z.flatten(0, 1)
        sl = z[:, 1:, -2:]
        sel = z.select(-1, 1)
        ch = z.chunk(2, dim=-1)[1]
        fl = z.flip(-1)
        m = z.mean(-1)
        pad = torch.nn.functional.pad(z, (1, 2))
        views = (t, p, u, c, s, f, sl, sel, ch, fl, m, pad)
        return [torch.view_as_real(v.contiguous()) for v in views]

    check(fn, [rand(2, 3, 4, 2), rand(2, 3, 4, 2)], backend, rtol=1e-5)


def test_complex_inputs_are_read_as_pairs(backend):
    def fn(z, w):
        return torch.view_as_real(z * w + 1.0)

    z = torch.complex(rand(3, 5), rand(3, 5))
    w = torch.complex(rand(5), rand(5))
    check(fn, [z, w], backend, rtol=1e-5)


def test_complex_output_is_named():
    model = torch.compile(
        lambda x: torch.polar(x, x), backend="ember", options={"fallback": "error"}
    )
    with pytest.raises(ember.EmberError, match="complex"):
        model(rand(4))


def test_unsupported_op_on_complex_is_named():
    model = torch.compile(
        lambda a: torch.view_as_real(torch.exp(torch.view_as_complex(a))),
        backend="ember",
        options={"fallback": "error"},
    )
    with pytest.raises(ember.EmberError, match="complex"):
        model(rand(4, 2))


def test_complex_buffer_read_from_a_pt2_archive(tmp_path):
    """A saved program's complex weight is read from the archive as its (real, imaginary)
    pairs, including a strided view of a larger storage."""
    model = LlamaRope()
    model.freqs_cis = model.freqs_cis[::2]  # a view: strides count complex elements
    xq, xk = rand(1, 6, 2, 16), rand(1, 6, 2, 16)
    path = tmp_path / "rope.pt2"
    torch.export.save(torch.export.export(model, (xq, xk)), path)
    compiled = ember.compile_pt2(path)
    for got, want in zip(compiled(xq, xk), model(xq, xk), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
