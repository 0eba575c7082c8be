"""``torch.compile(model, backend="ember", options={"export": "onnx"})``: the Dynamo graph is
exported with ``torch.onnx.export`` and compiled by the ONNX frontend; results match eager.

Tolerance: matrix products accumulate in another order than torch's GEMM, so rtol/atol 1e-5."""

from __future__ import annotations

import pytest
import torch
from ember.backend import programs_compiled


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU())
        self.norm = torch.nn.LayerNorm(24)
        self.a = torch.nn.Linear(24, 5)
        self.b = torch.nn.Linear(24, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(self.body(x))
        return torch.softmax(self.a(h), dim=-1), self.b(h).sum(dim=0)


def test_export_onnx_matches_eager() -> None:
    torch.manual_seed(0)
    model = TwoHeads().eval()
    before = programs_compiled()
    fast = torch.compile(model, backend="ember", options={"export": "onnx", "fallback": "error"})
    x = torch.randn(6, 12)
    with torch.no_grad():
        got = fast(x)
        want = model(x)
    assert programs_compiled() == before + 1
    assert isinstance(got, tuple) and len(got) == 2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_export_option_is_validated() -> None:
    import ember

    with pytest.raises(ValueError, match="valid: pt2, onnx"):
        ember.Options.from_dict({"export": "tflite"})
