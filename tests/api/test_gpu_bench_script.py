"""``bench.gpu_llama`` on its small CPU config (how the script is checked without a GPU):
the searched runner's line says what the search chose, and its logits stay as close to the
f32 model's as eager bf16's."""

from __future__ import annotations

import json

import pytest

gpu_llama = pytest.importorskip("bench.gpu_llama")


def test_the_gpu_bench_runs_its_small_config_and_reports_the_search(tmp_path, capsys):
    out = tmp_path / "llama.json"
    args = ["--tiny", "--device", "cpu", "--lengths", "8", "--prompt", "0"]
    args += ["--runners", "eager,ember-search", "--repeats", "1", "--warmup", "0"]
    assert gpu_llama.main([*args, "--ember-budget", "30", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "ember-search:" in printed and "; search: chose " in printed, printed
    (row,) = json.loads(out.read_text())["decode"]
    assert row["ember-search"] is not None, row
    # bf16 logits against the f32 model: Ember's error is eager's, give or take rounding.
    assert row["ember-search_max_abs_err"] <= 2 * row["eager_max_abs_err"] + 1e-3, row
