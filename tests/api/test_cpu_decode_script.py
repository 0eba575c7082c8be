"""``bench.cpu_decode`` on its small config: every run matches eager and is printed."""

from __future__ import annotations

import pytest

cpu_decode = pytest.importorskip("bench.cpu_decode")


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_the_cpu_decode_bench_runs_its_small_config(capsys, dtype):
    argv = ["--tiny", "--layers", "2", "--lengths", "5,19", "--prefill", "9", "--repeats", "2"]
    assert cpu_decode.main([*argv, "--dtype", dtype]) == 0
    printed = capsys.readouterr().out
    for run in ("decode, cache 5", "decode, cache 19", "prefill, 9 tokens"):
        assert f"| {run} |" in printed, printed
    assert "WRONG" not in printed, printed
