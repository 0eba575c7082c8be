"""Device selection: asking for CUDA gives a clear error where it cannot run."""

from __future__ import annotations

import ember
import pytest
import torch


def test_cuda_probes_answer_without_a_gpu():
    assert ember.cuda_built() in (True, False)
    assert ember.cuda_available() in (True, False)
    if not ember.cuda_built():
        assert not ember.cuda_available()


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
