"""`ember.profile_cpu()`: per-step timings of compiled CPU programs, by op and shape."""

from __future__ import annotations

import ember
import torch
from ember.models import MLP


def test_profile_counts_every_step_of_every_call():
    model = MLP((16, 32, 32, 8)).eval()
    x = torch.randn(4, 16)
    compiled = ember.compile(model, x, search_iterations=0, quiet=True)
    expected = model(x)
    with ember.profile_cpu() as prof:
        for _ in range(3):
            got = compiled(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert prof.rows, "nothing was timed"
    # Three linear layers, each a GEMM step (fused with its bias/activation or plain),
    # three calls: nine GEMM steps, each with the layer's output shape.
    gemm = [r for r in prof.rows if "dot" in r.label]
    assert sum(r.steps for r in gemm) == 9
    assert {r.shape for r in gemm} == {(4, 32), (4, 8)}
    assert all(r.seconds >= 0 for r in prof.rows)
    assert abs(sum(prof.by_label().values()) - prof.total_s) < 1e-12
    assert "dot" in str(prof)


def test_profile_is_off_outside_the_block():
    model = MLP((16, 32, 32, 8)).eval()
    x = torch.randn(4, 16)
    compiled = ember.compile(model, x, search_iterations=0, quiet=True)
    with ember.profile_cpu() as prof:
        compiled(x)
    compiled(x)  # after the block: not counted, and not left for the next block
    with ember.profile_cpu() as again:
        pass
    assert prof.rows and not again.rows
