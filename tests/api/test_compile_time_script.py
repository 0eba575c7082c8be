"""``bench.compile_time`` on its small config: both compiles (cold, then with the export
cached) run, match eager, and print their times."""

from __future__ import annotations

import pytest

compile_time = pytest.importorskip("bench.compile_time")


def test_the_compile_time_bench_runs_its_small_config(capsys):
    assert compile_time.main(["--tiny", "--layers", "2", "--search", "2"]) == 0
    printed = capsys.readouterr().out
    assert "cold: first call" in printed and "export cached: first call" in printed, printed
    assert "search: the compile cache's choice" in printed, printed
