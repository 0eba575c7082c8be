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
def test_device_cuda_on_a_gpu_says_the_runtime_is_not_built_yet():
    with pytest.raises(NotImplementedError, match="not implemented yet"):
        ember.compile(torch.nn.Linear(4, 4), torch.randn(2, 4), device="cuda")
