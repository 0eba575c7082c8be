"""``ember demo``: each built-in model compiles, matches eager (the demo exits 1 when its
output differs from eager PyTorch by more than 1e-4) and reports its speed."""

import pytest
from ember.cli import DEMO_MODELS, main


@pytest.mark.parametrize("model", DEMO_MODELS)
def test_demo_runs_and_matches_eager(model, capsys):
    if model in ("qwen", "gpt2", "bert", "mixtral"):
        pytest.importorskip("transformers")
    assert main(["demo", "--model", model, "--seq", "16", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "max abs error vs eager" in out and "speed-up" in out


def test_demo_rejects_unknown_model(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--model", "nonexistent"])
    assert "invalid choice" in capsys.readouterr().err
