"""``ember run`` and ``ember bench`` on a saved ONNX model."""

from __future__ import annotations

import numpy as np
import onnx
from ember.cli import main
from onnx import helper
from onnx_util import make_model, randn


def _save(tmp_path) -> str:
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Tanh", ["h"], ["y"]),
        helper.make_node("ArgMax", ["y"], ["i"], axis=-1),
    ]
    model = make_model(
        nodes,
        {"x": randn(2, 8)},
        ["y", "i"],
        {"w": randn(8, 4, seed=1)},
        input_shapes={"x": ["batch", 8]},
    )
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    return str(path)


def test_run_random_inputs(tmp_path, capsys) -> None:
    path = _save(tmp_path)
    assert main(["run", path, "--dim", "batch=5", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "output y: shape [5, 4] float32 checksum" in out
    assert "output i: shape [5, 1] int64" in out
    assert "latency" in out


def test_run_given_inputs(tmp_path, capsys) -> None:
    path = _save(tmp_path)
    x = randn(3, 8, seed=4)
    np.save(tmp_path / "x.npy", x)
    assert main(["run", path, "--input", f"x={tmp_path / 'x.npy'}", "--repeats", "1"]) == 0
    assert "output y: shape [3, 4]" in capsys.readouterr().out


def test_bench_against_onnxruntime(tmp_path, capsys) -> None:
    path = _save(tmp_path)
    assert main(["bench", path, "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "onnxruntime latency" in out and "ratio" in out


def test_usage() -> None:
    assert main([]) == 2
