"""Device selection: asking for CUDA gives a clear error where it cannot run."""

from __future__ import annotations

import ember
import numpy as np
import pytest
import torch
from conftest import onnx_mlp


def test_cuda_probes_answer_without_a_gpu():
    assert ember.cuda_built() in (True, False)
    assert ember.cuda_available() in (True, False)
    if not ember.cuda_built():
        assert not ember.cuda_available()


@pytest.mark.skipif(ember.cuda_available(), reason="a GPU is present")
def test_no_products_are_measured_without_a_gpu():
    assert ember.cuda.product_tuning() == []


def test_invalid_device_option_is_refused():
    with pytest.raises(ValueError, match="device='tpu'"):
        ember.compile(torch.nn.Linear(4, 4), torch.randn(2, 4), device="tpu")


@pytest.mark.skipif(ember.cuda_available(), reason="a GPU is present")
def test_device_cuda_without_a_gpu_raises_clearly():
    with pytest.raises(RuntimeError, match="no usable NVIDIA GPU|no CUDA backend"):
        ember.compile(torch.nn.Linear(4, 4), torch.randn(2, 4), device="cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not ember.cuda_available(), reason="needs an NVIDIA GPU")
def test_cuda_tensors_select_the_cuda_backend_and_stay_on_the_gpu():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    model = model.cuda().eval()
    x = torch.randn(4, 16, device="cuda")
    compiled = ember.compile(model, x)
    got = compiled(x)
    assert got.device.type == "cuda"
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-4)
    with pytest.raises(ember.InputError, match="cuda:0"):
        compiled(x.cpu())


@pytest.mark.cuda
@pytest.mark.skipif(not ember.cuda_available(), reason="needs an NVIDIA GPU")
def test_the_search_on_a_gpu_times_candidates_with_cuda_events():
    # (The Rust tests run the same timer on the emulator, which Python never searches.)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8))
    model = model.cuda().eval()
    x = torch.randn(32, 64, device="cuda")
    compiled = ember.compile(model, x, cache=False, quiet=True)
    r = compiled.report()
    assert r.clock == "device", str(r)
    assert r.chosen is not None and all(c.verified for c in r.candidates), str(r)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(ember.cuda_available(), reason="a GPU is present")
def test_compile_onnx_on_cuda_without_a_gpu_raises_clearly():
    pytest.importorskip("onnx")
    data, _ = onnx_mlp()
    with pytest.raises(RuntimeError, match="no usable NVIDIA GPU|no CUDA backend"):
        ember.compile_onnx(data, device="cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not ember.cuda_available(), reason="needs an NVIDIA GPU")
def test_compile_onnx_on_cuda_matches_onnxruntime():
    ort = pytest.importorskip("onnxruntime")
    data, x = onnx_mlp()
    (want,) = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    compiled = ember.compile_onnx(data, device="cuda")
    (got,) = compiled(x)  # numpy in, numpy out
    assert isinstance(got, np.ndarray)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    (on_gpu,) = compiled(torch.from_numpy(x).cuda())  # torch CUDA in, torch CUDA out
    assert on_gpu.device.type == "cuda"
    np.testing.assert_allclose(on_gpu.cpu().numpy(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not ember.cuda_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_of_tensors_at_unaligned_addresses(dtype):
    """A tensor with a storage offset (`x[1:]` of rows of 7) is contiguous but aligned only
    to its element: cuBLASLt must be told so (it assumes 256 bytes otherwise)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(7, 5).cuda().to(dtype).eval()

    def fn(h, r):
        return r + model(h)

    big_h = torch.randn(6, 7, device="cuda", dtype=dtype)
    big_r = torch.randn(6, 5, device="cuda", dtype=dtype)
    h, r = big_h[1:], big_r[1:]
    assert h.is_contiguous() and h.data_ptr() % 16 != 0
    compiled = torch.compile(fn, backend="ember")
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    with torch.no_grad():
        torch.testing.assert_close(compiled(h, r), fn(h, r), rtol=tol, atol=tol)
        # The same program on aligned copies (the recording patched to new addresses).
        h2, r2 = h.clone(), r.clone()
        torch.testing.assert_close(compiled(h2, r2), fn(h2, r2), rtol=tol, atol=tol)


class _Products(torch.nn.Module):
    """A one-row linear layer (a decode step's) alone and with a residual added, a batched
    product and one whose left operand is transposed in place: each layout and epilogue
    the product libraries are called with."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(40, 48, dtype=dtype) / 7)
        self.o = torch.nn.Parameter(torch.randn(40, 40, dtype=dtype) / 7)

    def forward(self, x, a, b, c):
        h = torch.nn.functional.linear(x, self.w)
        return h, h + torch.nn.functional.linear(h, self.o), torch.bmm(a, b), a.transpose(1, 2) @ c


@pytest.mark.cuda
@pytest.mark.skipif(not ember.cuda_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("library", ["measured", "cublas", "cublaslt"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_match_eager_whichever_library_runs_them(monkeypatch, library, dtype):
    """Each product shape's kernel is measured among cuBLASLt's algorithms and cuBLAS
    (`products.rs`); each library forced alone must give eager's numbers too, since the
    measurement may pick either."""
    if library != "measured":
        monkeypatch.setenv("EMBER_CUDA_PRODUCT_LIBRARY", library)
    torch.manual_seed(0)
    model = _Products(dtype).cuda().eval()
    args = [
        torch.randn(1, 48),
        torch.randn(3, 24, 33),
        torch.randn(3, 33, 17),
        torch.randn(3, 24, 19),
    ]
    args = [t.to("cuda", dtype) for t in args]
    # Unsearched: every product on the libraries (a searched program may take a generated
    # product kernel instead).
    compiled = ember.compile(model, *args, cache=False, quiet=True, search_iterations=0)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    with torch.no_grad():
        for got, want in zip(compiled(*args), model(*args), strict=True):
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if library == "measured":
        one_row = [t for t in ember.cuda.product_tuning() if "[1×48]·[48×40]" in t["product"]]
        assert one_row, ember.cuda.product_tuning()
        for t in one_row:
            times = dict(t["candidates"])
            assert len(times) > 1 and times[t["chosen"]] is not None, t
            assert times[t["chosen"]] == min(v for v in times.values() if v is not None), t


@pytest.mark.cuda
@pytest.mark.skipif(not ember.cuda_available(), reason="needs an NVIDIA GPU")
def test_two_programs_run_at_once_on_two_streams():
    """Each program has its own cuBLASLt workspace and records its graphs one capture at a
    time: two threads, each with a program and a stream of its own, never mix results."""
    import threading

    torch.manual_seed(0)
    models = [
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        .cuda()
        .eval()
        for _ in range(2)
    ]
    x = torch.randn(128, 64, device="cuda")
    compiled = [ember.compile(m, x, search_iterations=0, cache=False) for m in models]
    with torch.no_grad():
        want = [m(x) for m in models]
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream), torch.no_grad():
                for _ in range(50):
                    got = compiled[k](x)
                    torch.testing.assert_close(got, want[k], rtol=1e-4, atol=1e-4)
            stream.synchronize()
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    torch.cuda.synchronize()  # `x` and `want` are ready before other streams read them
    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def _linear(device: str, features: int) -> torch.nn.Linear:
    torch.manual_seed(0)
    lin = torch.nn.Linear(features, features, bias=False).to(device).eval()
    with torch.no_grad():
        # An aligned weight is read in place (an unaligned one would be copied, aligned).
        lin.weight = torch.nn.Parameter(ember.compiled._aligned(lin.weight.detach()))
    return lin


@pytest.mark.skipif(not ember.cuda_built(), reason="built without the CUDA backend")
def test_the_emulated_cuda_backend_reads_weights_in_place():
    """The CUDA backends read weights where they are (the GPU: torch's CUDA parameters; the
    emulator: host memory) instead of uploading copies: a change torch does not count as an
    update (through `.data`) is seen by the next call, as only memory read in place can."""
    lin = _linear("cpu", 16)
    x = torch.randn(3, 16)
    compiled = ember.compile(lin, x, backend="cuda-emu", search_iterations=0, quiet=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), lin(x))
        lin.weight.data.mul_(2.0)  # `.data`: the parameter's version is not bumped
        torch.testing.assert_close(compiled(x), lin(x))


@pytest.mark.cuda
@pytest.mark.skipif(not ember.cuda_available(), reason="needs an NVIDIA GPU")
def test_cuda_weights_are_not_copied_to_the_gpu_again():
    """A 256 MB weight on the GPU: compiling takes no second 256 MB of device memory (the
    program reads torch's parameter in place), and reads the parameter's current values."""
    lin = _linear("cuda", 8192)  # 8192² f32: 256 MiB
    x = torch.randn(2, 8192, device="cuda")
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    compiled = ember.compile(lin, x, search_iterations=0, quiet=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), lin(x), rtol=1e-4, atol=1e-3)
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info()[0]
        assert used < 128 << 20, f"compiling took {used >> 20} MiB of device memory"
        lin.weight.data.mul_(2.0)
        torch.testing.assert_close(compiled(x), lin(x), rtol=1e-4, atol=1e-3)
