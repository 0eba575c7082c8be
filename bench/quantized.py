"""Quantized ONNX models: a 256→1024→256 MLP (ReLU) at batch 32 and a small residual CNN at
1×3×112×112, exported as float and quantized by ``onnxruntime.quantization`` (static with
calibration in the QDQ and QOperator formats, and dynamic for the MLP), each run by Ember
(``ember.compile_onnx``) and ONNX Runtime in the same process, 2 threads, medians of timed
calls after a warm-up (the CNN's calls a tenth of ``--calls``).

    python3 -m bench.quantized [--calls 300]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ember
import numpy as np
import onnxruntime as ort
import torch
from onnxruntime import quantization


def _median_us(fn: Callable[[], Any], calls: int) -> float:
    for _ in range(max(10, calls // 10)):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6


class _Calibration(quantization.CalibrationDataReader):
    def __init__(self, shape: tuple[int, ...]) -> None:
        gen = torch.Generator().manual_seed(1)
        self.batches = iter([{"x": torch.randn(shape, generator=gen).numpy()} for _ in range(4)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.batches, None)


class _Block(torch.nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.a = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.b = torch.nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.b(torch.relu(self.a(x))))


def _cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        _Block(32),
        torch.nn.Conv2d(32, 64, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        _Block(64),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(64, 10),
    ).eval()


def _models(folder: Path) -> list[tuple[str, Path, tuple[int, ...]]]:
    """(name, ONNX file, input shape) of every benchmarked model."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)
    ).eval()
    out = []
    for net, model, shape in [("MLP", mlp, (32, 256)), ("CNN", _cnn(), (1, 3, 112, 112))]:
        float_path = folder / f"{net}.onnx"
        with torch.no_grad():
            torch.onnx.export(
                model, (torch.randn(shape),), str(float_path), dynamo=False, input_names=["x"]
            )
        out.append((f"{net} float", float_path, shape))
        for fmt in ["QDQ", "QOperator"]:
            path = folder / f"{net}.{fmt}.onnx"
            quantization.quantize_static(
                str(float_path),
                str(path),
                _Calibration(shape),
                quant_format=getattr(quantization.QuantFormat, fmt),
                per_channel=net == "CNN",
            )
            out.append((f"{net} {fmt} (static)", path, shape))
        if net == "MLP":
            dynamic = folder / "MLP.dynamic.onnx"
            quantization.quantize_dynamic(str(float_path), str(dynamic))
            out.append(("MLP dynamic", dynamic, shape))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(2)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    print("| model | Ember µs | ORT µs | Ember / ORT | max abs error |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, path, shape in _models(Path(tmp)):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(2)).numpy()
            calls = args.calls if len(shape) == 2 else max(10, args.calls // 10)
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            compiled = ember.compile_onnx(str(path), num_threads=2)
            want = session.run(None, {"x": x})[0]
            got = compiled(x)
            got = got[0] if isinstance(got, list | tuple) else got
            error = float(np.abs(np.asarray(got) - want).max())
            ours = _median_us(lambda c=compiled, x=x: c(x), calls)
            theirs = _median_us(lambda s=session, x=x: s.run(None, {"x": x}), calls)
            print(f"| {name} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f}× | {error:.1e} |")


if __name__ == "__main__":
    main()
