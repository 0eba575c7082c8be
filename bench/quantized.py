"""Quantized ONNX models: a 256→1024→256 MLP (ReLU) at batch 32, exported as float and
quantized by ``onnxruntime.quantization`` (static QDQ with calibration, and dynamic), each
run by Ember (``ember.compile_onnx``) and ONNX Runtime in the same process, 2 threads,
medians of timed calls after a warm-up.

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
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1)
        self.batches = iter([{"x": torch.randn(32, 256, generator=gen).numpy()} for _ in range(4)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.batches, None)


def _models(folder: Path) -> dict[str, Path]:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)
    ).eval()
    float_path = folder / "float.onnx"
    with torch.no_grad():
        torch.onnx.export(
            mlp, (torch.randn(32, 256),), str(float_path), dynamo=False, input_names=["x"]
        )
    qdq, dynamic = folder / "qdq.onnx", folder / "dynamic.onnx"
    quantization.quantize_static(
        str(float_path), str(qdq), _Calibration(), quant_format=quantization.QuantFormat.QDQ
    )
    quantization.quantize_dynamic(str(float_path), str(dynamic))
    return {"float": float_path, "QDQ (static)": qdq, "dynamic": dynamic}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(2)
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(2)).numpy()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    print("| model | Ember µs | ORT µs | Ember / ORT | max abs error |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in _models(Path(tmp)).items():
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            compiled = ember.compile_onnx(str(path), num_threads=2)
            want = session.run(None, {"x": x})[0]
            got = compiled(x)
            got = got[0] if isinstance(got, list | tuple) else got
            error = float(np.abs(np.asarray(got) - want).max())
            ours = _median_us(lambda c=compiled: c(x), args.calls)
            theirs = _median_us(lambda s=session: s.run(None, {"x": x}), args.calls)
            print(f"| {name} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f}× | {error:.1e} |")


if __name__ == "__main__":
    main()
