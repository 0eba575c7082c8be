"""Recorded runs (CUDA graphs): a program is recorded once per dim bucket and replayed,
with the caller's new buffers and sizes patched in; every call still matches the reference.

The recording logic is the executor's, shared by the GPU and the emulator ("cuda-emu"), so
these tests run everywhere the CUDA backend is built; the GPU variants need a GPU."""

from __future__ import annotations

import ember
import numpy as np
import pytest
import torch
from conftest import onnx_mlp

pytestmark = pytest.mark.skipif(not ember.cuda_built(), reason="built without the CUDA backend")

# Row counts across three buckets (≤16, 17-32, 33-64), revisiting the first.
SIZES = (3, 20, 31, 17, 40, 3, 12)


def _on(device: str):
    if device == "cuda":
        return pytest.param(
            "cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(not ember.cuda_available(), reason="needs an NVIDIA GPU"),
            ],
        )
    return device


def _compile(data: bytes, device: str):
    if device == "cuda":
        return ember.compile_onnx(data, device="cuda")
    return ember.compile_onnx(data, backend="cuda-emu")


def _reference(data: bytes):
    ort = pytest.importorskip("onnxruntime")
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("device", [_on("cuda-emu"), _on("cuda")])
def test_one_recording_per_bucket_serves_every_size_and_new_buffers(device):
    pytest.importorskip("onnx")
    data, _ = onnx_mlp()
    ref = _reference(data)
    compiled = _compile(data, device)
    rng = np.random.default_rng(1)
    for n in SIZES:
        x = rng.standard_normal((n, 16), np.float32)
        (want,) = ref.run(None, {"x": x})
        (got,) = compiled(x)  # a new input and output buffer every call
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"n={n}")
    stats = compiled._compiled.run_stats()
    assert stats["record_failures"] == 0, stats
    assert stats["replayed"] == len(SIZES) and stats["direct"] == 0, stats
    # One recording per bucket; the arena grows at most once per new larger bucket, which
    # drops older recordings (so the revisited first bucket may be recorded again).
    assert 3 <= stats["recorded"] <= 5, stats
    assert stats["patched"] > 0, stats


@pytest.mark.parametrize("device", [_on("cuda-emu"), _on("cuda")])
def test_the_same_buffers_again_replay_without_patching(device):
    pytest.importorskip("onnx")
    data, x = onnx_mlp()
    (want,) = _reference(data).run(None, {"x": x})
    compiled = _compile(data, device)
    dev = "cuda" if device == "cuda" else "cpu"
    xt = torch.from_numpy(x).to(dev)
    out = None
    for _ in range(4):
        (out,) = compiled(xt)
    np.testing.assert_allclose(out.cpu().numpy(), want, rtol=1e-4, atol=1e-4)
    stats = compiled._compiled.run_stats()
    assert stats["recorded"] == 1 and stats["replayed"] == 4, stats


@pytest.mark.parametrize("device", [_on("cuda-emu"), _on("cuda")])
def test_calls_alternating_between_buffers_match_the_reference(device):
    """A loop holding only its last output hands the allocator's blocks out in turn: the
    products writing them are patched back and forth (on the GPU, to captures a product
    node keeps), and every call must still write its own output from its own input."""
    pytest.importorskip("onnx")
    data, _ = onnx_mlp()
    ref = _reference(data)
    compiled = _compile(data, device)
    dev = "cuda" if device == "cuda" else "cpu"
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((5, 16), np.float32) for _ in range(2)]
    wants = [ref.run(None, {"x": x})[0] for x in xs]
    inputs = [torch.from_numpy(x).to(dev) for x in xs]
    last = None
    for call in range(8):
        (out,) = compiled(inputs[call % 2])
        got = out.cpu().numpy()
        np.testing.assert_allclose(got, wants[call % 2], rtol=1e-4, atol=1e-4, err_msg=f"{call}")
        last = out  # the previous call's output is freed now, the one before reused
    assert last is not None
    stats = compiled._compiled.run_stats()
    assert stats["record_failures"] == 0 and stats["replayed"] == 8, stats


def test_graphs_can_be_turned_off(monkeypatch):
    pytest.importorskip("onnx")
    monkeypatch.setenv("EMBER_CUDA_GRAPHS", "0")
    data, _ = onnx_mlp()
    ref = _reference(data)
    compiled = _compile(data, "cuda-emu")
    rng = np.random.default_rng(2)
    for n in (4, 30):
        x = rng.standard_normal((n, 16), np.float32)
        (want,) = ref.run(None, {"x": x})
        (got,) = compiled(x)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    stats = compiled._compiled.run_stats()
    assert stats["direct"] == 2 and stats["replayed"] == stats["recorded"] == 0, stats


@pytest.mark.parametrize("device", [_on("cuda-emu"), _on("cuda")])
def test_a_decode_loop_with_a_growing_cache_matches_eager(device):
    """One symbolic program serves every step of a decode loop (the cache grows by one
    position per step); the recordings follow the buckets."""
    from ember.models import Llama, LlamaConfig, LlamaDecodeStep, llama_cache

    torch.manual_seed(0)
    cfg = LlamaConfig(layers=2, dim=64, heads=4, kv_heads=2, hidden=128, vocab=96)
    model = LlamaDecodeStep(Llama(cfg)).eval()
    dev = "cuda" if device == "cuda" else "cpu"
    model = model.to(dev)
    options = {} if device == "cuda" else {"backend": "cuda-emu"}
    fast = torch.compile(model, backend="ember", dynamic=True, options=options)
    cache = [t.to(dev) for t in llama_cache(cfg, 1, 14)]
    with torch.no_grad():
        for step in range(5):  # cache lengths 14..18: across the 16/17 bucket boundary
            token = torch.randint(0, cfg.vocab, (1, 1), device=dev)
            want = model(token, *cache)
            got = fast(token, *cache)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=f"step {step}")
            cache = list(want[1:])
