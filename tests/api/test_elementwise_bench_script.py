"""``bench.elementwise`` on small inputs: each op it times is checked against eager and
printed as a row."""

from __future__ import annotations

import pytest

elementwise = pytest.importorskip("bench.elementwise")


def test_the_elementwise_bench_checks_and_prints_each_op(capsys):
    ops = ["erf", "log", "sin", "gelu"]
    argv = ["--rows", "3", "--repeats", "20", "--ops", ",".join(ops)]
    assert elementwise.main(argv) == 0
    printed = capsys.readouterr().out
    for op in ops:
        assert f"| {op} | " in printed, printed
