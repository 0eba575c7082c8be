"""GridSample against ONNX Runtime: linear and nearest sampling, every padding mode, both
corner alignments, 2-d and 3-d, grids reaching past the image; and torch's
``F.grid_sample`` as its exporter writes it, against eager."""

from __future__ import annotations

import ember
import numpy as np
import pytest
import torch
from onnx_util import BACKENDS, check, compile_on, randn, single

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _grid(*shape: int, seed: int) -> np.ndarray:
    """Positions over [-1.3, 1.3] (past the image on every side), with exact pixel centers,
    edges and halfway points mixed in."""
    g = np.random.default_rng(seed).uniform(-1.3, 1.3, size=shape).astype(np.float32)
    flat = g.reshape(-1)
    flat[:6] = [-1.0, 1.0, 0.0, 0.5, -0.75, 1.25]
    return g


@pytest.mark.parametrize("align_corners", [0, 1])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize(("mode", "opset"), [("bilinear", 16), ("linear", 20), ("nearest", 20)])
def test_grid_sample_2d(mode: str, opset: int, padding_mode: str, align_corners: int) -> None:
    x = randn(2, 3, 5, 7, seed=1)
    grid = _grid(2, 4, 6, 2, seed=2)
    attrs = {"mode": mode, "padding_mode": padding_mode, "align_corners": align_corners}
    model = single("GridSample", {"x": x, "grid": grid}, attrs, opset=opset)
    check(model, {"x": x, "grid": grid}, **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("padding_mode", ["zeros", "reflection"])
@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_grid_sample_3d(mode: str, padding_mode: str, backend: str) -> None:
    x = randn(1, 2, 3, 4, 5, seed=3)
    grid = _grid(1, 2, 3, 4, 3, seed=4)
    attrs = {"mode": mode, "padding_mode": padding_mode}
    model = single("GridSample", {"x": x, "grid": grid}, attrs, opset=20)
    compiled = compile_on(model, backend)
    check(model, {"x": x, "grid": grid}, compiled=compiled, **TOL)


def test_grid_sample_of_one_pixel_with_aligned_corners() -> None:
    """A 1-pixel axis: every position is that pixel (the reflection span is 0)."""
    x = randn(1, 2, 1, 4, seed=5)
    grid = _grid(1, 3, 3, 2, seed=6)
    attrs = {"padding_mode": "reflection", "align_corners": 1}
    model = single("GridSample", {"x": x, "grid": grid}, attrs, opset=20)
    check(model, {"x": x, "grid": grid}, **TOL)


def test_cubic_grid_sample_is_refused() -> None:
    x, grid = randn(1, 1, 4, 4, seed=1), _grid(1, 2, 2, 2, seed=2)
    model = single("GridSample", {"x": x, "grid": grid}, {"mode": "cubic"}, opset=20)
    with pytest.raises(ember.UnsupportedOpError, match="cubic"):
        ember.compile_onnx(model)


def test_torch_grid_sample_exported(tmp_path) -> None:
    class Warp(torch.nn.Module):
        def forward(self, x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.grid_sample(x, grid, align_corners=False)

    x = torch.randn(2, 3, 8, 8)
    grid = torch.from_numpy(_grid(2, 5, 5, 2, seed=7))
    path = tmp_path / "warp.onnx"
    torch.onnx.export(Warp(), (x, grid), str(path), dynamo=True, input_names=["x", "grid"])
    (got,) = ember.compile_onnx(str(path))(x=x.numpy(), grid=grid.numpy())
    with torch.no_grad():
        want = Warp()(x, grid).numpy()
    np.testing.assert_allclose(got, want, **TOL)
