"""Recurrent layers from torch's exporter (``nn.LSTM`` and ``nn.GRU``, batch first, one
layer) as ONNX files, run by Ember (``ember.compile_onnx``, the layer unrolled over the
sequence) and ONNX Runtime (its fused LSTM/GRU kernels) in the same process, 2 threads,
medians of timed calls after a warm-up; plus Ember's compile time.

    python3 -m bench.recurrent [--calls 200]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time
from pathlib import Path

import ember
import numpy as np
import onnxruntime as ort
import torch

from bench.quantized import _median_us

# (kind, batch, steps, hidden): a small tagger, a speech-style layer.
CASES = [("LSTM", 1, 16, 128), ("LSTM", 4, 64, 256), ("GRU", 4, 64, 256)]


class _Outputs(torch.nn.Module):
    def __init__(self, rnn: torch.nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(2)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    print("| layer | batch × steps × hidden | Ember µs | ORT µs | Ember / ORT | compile s |")
    print("|---|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for kind, batch, steps, hidden in CASES:
            torch.manual_seed(0)
            model = _Outputs(getattr(torch.nn, kind)(hidden, hidden, batch_first=True)).eval()
            x = torch.randn(batch, steps, hidden)
            path = Path(tmp) / f"{kind}.onnx"
            with contextlib.redirect_stdout(io.StringIO()):
                torch.onnx.export(model, (x,), str(path), dynamo=True, input_names=["x"])
            start = time.perf_counter()
            compiled = ember.compile_onnx(str(path), num_threads=2, quiet=True)
            compile_s = time.perf_counter() - start
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            xn = x.numpy()
            error = np.abs(compiled(x=xn)[0] - session.run(None, {"x": xn})[0]).max()
            assert error < 1e-4, f"{kind}: Ember and ORT differ by {error}"
            ours = _median_us(lambda c=compiled, xn=xn: c(x=xn), args.calls)
            theirs = _median_us(lambda s=session, xn=xn: s.run(None, {"x": xn}), args.calls)
            shape = f"{batch} × {steps} × {hidden}"
            print(
                f"| {kind} | {shape} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f}× "
                f"| {compile_s:.1f} |"
            )


if __name__ == "__main__":
    main()
