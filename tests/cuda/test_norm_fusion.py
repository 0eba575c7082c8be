"""Norms fused on the CUDA backend, checked on the emulated kernels (and the GPU where there
is one) against eager PyTorch, with the launches they save:

* RMS norms computed inside the `cuda.warp_dot` products that read them (the code
  generator's `folded_norm.rs`): each warp normalizes its row itself, so the norm has no
  launch of its own — in each float dtype, packed and element-wise loads, one row and
  several, `F.rms_norm` with and without a weight and transformers' `LlamaRMSNorm`;
* a norm writing the pointwise chain it flows through (transformers' 16-bit
  `weight * norm(x.to(f32)).to(dtype)`): one launch instead of two."""

from __future__ import annotations

import ember
import pytest
import torch
import torch.nn.functional as F
from conftest import Fn, check, rand
from ember import _core, cuda
from ember.export import export_program, save_bytes

pytestmark = pytest.mark.skipif(not cuda.cuda_built(), reason="built without the CUDA backend")

WARP_DOT = "cuda.warp_dot"
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}

ON_THE_GPU = pytest.param(
    "cuda",
    marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not ember.cuda_available(), reason="needs an NVIDIA GPU"),
    ],
)


class TransformersNorm(torch.nn.Module):
    """transformers' `LlamaRMSNorm`: normalized in f32, rounded to the input's dtype, then
    multiplied by the weight (rounded again)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * rand(k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class Projections(torch.nn.Module):
    """A norm read by two products of its rows (one launch for both) and by a gated pair
    (one launch with its `silu(gate) * up` epilogue), as a decode layer's norms are."""

    def __init__(self, k: int, norm: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(1 + 0.1 * rand(k)) if norm == "torch" else None
        self.hf = TransformersNorm(k) if norm == "transformers" else None
        self.q, self.kv, self.gate, self.up = (
            torch.nn.Linear(k, n, bias=False) for n in (16, 8, 24, 24)
        )
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.hf is not None:
            h = self.hf(x)
        else:
            h = F.rms_norm(x, (x.shape[-1],), self.w, 1e-5)
        return torch.cat([self.q(h), self.kv(h)], -1), F.silu(self.gate(h)) * self.up(h)


def _steps(model: torch.nn.Module, x: torch.Tensor | list, choice: str | None) -> int:
    args = x if isinstance(x, list) else [x]
    program = _core.load_pt2(data=save_bytes(export_program(model, args)), load_weights=False)
    return cuda.generated_source(program, choice)["steps"]


@pytest.mark.parametrize("backend", ["cuda-emu", ON_THE_GPU])
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("norm", ["torch", "no_weight", "transformers"])
# 64 columns are read in 16-byte packs; 36 are not a whole number of packs (element-wise).
@pytest.mark.parametrize("rows,k", [(1, 64), (6, 64), (6, 36)])
def test_a_norm_read_only_by_products_is_computed_inside_them(
    rows, k, norm, dtype, backend, monkeypatch
):
    monkeypatch.setenv("EMBER_CUDA_PRODUCTS", WARP_DOT)
    monkeypatch.setenv("EMBER_EMULATE_GPU_LAUNCHES", "1")
    torch.manual_seed(0)
    model = Projections(k, norm, dtype).eval()
    x = rand(1, rows, k).to(dtype) * 3
    tol = TOLERANCE[dtype]
    check(model, [x], backend, rtol=tol, atol=tol, new_inputs=[rand(1, rows, k).to(dtype)])
    # The norm's launch is gone: q and kv, their concat, the gated pair — against the norm,
    # four products, the concat and the gate's elementwise kernel.
    assert _steps(model, x, WARP_DOT) == 3
    assert _steps(model, x, None) == 7


def test_a_norm_read_by_anything_else_keeps_its_launch(monkeypatch):
    """A norm that is also an output (or read by any op but a product's rows) is computed
    once, in memory, and the products read it."""
    monkeypatch.setenv("EMBER_CUDA_PRODUCTS", WARP_DOT)

    def fn(x, w, p):
        h = F.rms_norm(x, (x.shape[-1],), w, 1e-6)
        return h @ p.t(), h

    args = [rand(3, 32), 1 + 0.1 * rand(32), rand(8, 32)]
    check(fn, args, "cuda-emu", rtol=1e-4, atol=1e-4)
    program = _core.load_pt2(data=save_bytes(export_program(Fn(fn), args)), load_weights=False)
    gen = cuda.generated_source(program, WARP_DOT)
    assert gen["steps"] == 2 and "rstd0" not in gen["source"]


def test_the_last_layers_norm_is_folded_too():
    """The final norm reads a residual add nothing else reads; that add is then kept in
    memory (written by the product before it) so the norm can still be folded."""
    torch.manual_seed(0)

    class Tail(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.down = torch.nn.Linear(32, 16, bias=False)
            self.norm = torch.nn.RMSNorm(16, eps=1e-5)
            self.head = torch.nn.Linear(16, 40, bias=False)

        def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            return self.head(self.norm(h + self.down(x)))

    model = Tail().eval()
    args = [rand(1, 1, 32), rand(1, 1, 16)]
    program = _core.load_pt2(data=save_bytes(export_program(model, args)), load_weights=False)
    # down (+ residual), head with the norm inside: two launches.
    assert cuda.generated_source(program, WARP_DOT)["steps"] == 2
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EMBER_CUDA_PRODUCTS", WARP_DOT)
        check(model, args, "cuda-emu", rtol=1e-4, atol=1e-4)


@pytest.mark.nvrtc
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_folded_norm_kernels_compile_with_nvrtc(dtype):
    if cuda.nvrtc_version() is None:
        pytest.skip("libnvrtc not found (install the CUDA build of torch)")
    model = Projections(64, "transformers", dtype).eval()
    x = rand(1, 1, 64).to(dtype)
    program = _core.load_pt2(data=save_bytes(export_program(model, [x])), load_weights=False)
    gen = cuda.generated_source(program, WARP_DOT)
    assert "rstd0" in gen["source"]
    for arch in ("sm_80", "sm_90"):
        assert cuda.nvrtc_compile(gen["source"], arch) > 0


@pytest.mark.parametrize("backend", ["cuda-emu", ON_THE_GPU])
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_a_norm_writes_the_pointwise_chain_it_flows_through(dtype, backend):
    """transformers' 16-bit RMS norm (normalized in f32, rounded, times the weight) and a
    layer norm followed by a scale and a tanh: each one kernel, writing the chain's end,
    before library products (cuBLASLt)."""
    torch.manual_seed(0)
    tol = TOLERANCE[dtype]
    model = Projections(64, "transformers", dtype).eval()
    x = rand(1, 6, 64).to(dtype) * 3
    check(model, [x], backend, rtol=tol, atol=tol)
    # The norm with its weight's product, four products, the concat, the gate's kernel.
    assert _steps(model, x, None) == 7

    def layer_norm_then_tanh(x, w, b, p):
        h = torch.tanh(F.layer_norm(x, (x.shape[-1],), w, b) * 0.5)
        return h @ p.t()

    args = [rand(5, 48).to(dtype), 1 + 0.1 * rand(48).to(dtype), rand(48).to(dtype)]
    args.append(rand(12, 48).to(dtype))
    check(layer_norm_then_tanh, args, backend, rtol=tol, atol=tol)
    assert _steps(Fn(layer_norm_then_tanh), args, None) == 2
