"""The export cache: a model compiled again (here, or in another process) skips torch.export
when its trace key matches, and runs correctly on its own current weights; anything that
changes what the export would make changes the key; models the key cannot vouch for are
exported as usual and left untouched."""

from __future__ import annotations

import ember
import pytest
import torch
import torch.nn.functional as F
from ember.models import MLP, Llama, LlamaConfig, LlamaDecodeStep, llama_cache
from ember.trace_key import model_key
from torch import nn

QUICK = {"search_iterations": 0, "quiet": True}


def _compile(model, *inputs, **options):
    return ember.compile(model, *inputs, **{**QUICK, **options})


def _check(compiled, model, *inputs):
    with torch.no_grad():
        expected = model(*[t.clone() for t in inputs])
    torch.testing.assert_close(compiled(*[t.clone() for t in inputs]), expected)


class _Scaled(nn.Module):
    """A linear layer, a plain tensor attribute (not a buffer: the export embeds its value)
    and a Python flag that picks the activation."""

    def __init__(self, scale: torch.Tensor, act: str = "gelu", eps: float = 1e-5) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 8)
        self.scale = scale
        self.act = act
        self.eps = eps

    def forward(self, x):
        h = F.layer_norm(self.fc(x), (8,), eps=self.eps) * self.scale
        return F.gelu(h) if self.act == "gelu" else F.silu(h)


def test_second_compile_skips_the_export_and_binds_the_new_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    x = torch.randn(5, 48)
    first_model = MLP((48, 40, 10)).eval()
    first = _compile(first_model, x)
    assert not first.report().export_cache_hit
    assert list((tmp_path / "exports").glob("*.zip"))
    # Same architecture, other weights: the same key, this model's weights bound.
    second_model = MLP((48, 40, 10)).eval()
    second = _compile(second_model, x)
    assert second.report().export_cache_hit
    assert "export cache" in str(second.report())
    _check(second, second_model, torch.randn(5, 48))
    _check(first, first_model, torch.randn(5, 48))
    # In-place weight updates after compiling are still seen on a hit.
    with torch.no_grad():
        second_model.layers[0].weight.mul_(-2.0)
    _check(second, second_model, torch.randn(5, 48))


def test_lifted_constants_come_back_from_the_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    torch.manual_seed(1)
    x = torch.randn(3, 12)
    scale = torch.randn(8)
    _compile(_Scaled(scale.clone()).eval(), x)
    model = _Scaled(scale.clone()).eval()
    compiled = _compile(model, x)
    assert compiled.report().export_cache_hit
    _check(compiled, model, torch.randn(3, 12))


def test_what_the_export_depends_on_changes_the_key():
    torch.manual_seed(2)
    x = torch.randn(3, 12)
    scale = torch.randn(8)
    model = _Scaled(scale).eval()
    key = model_key(model, [x])
    assert key is not None
    assert model_key(model, [torch.randn(3, 12)]) == key  # input values do not matter
    torch.manual_seed(3)
    assert model_key(_Scaled(scale).eval(), [x]) == key  # nor parameter values
    others = [
        model_key(model, [torch.randn(4, 12)]),
        model_key(model, [torch.randn(12, 3).t()]),  # strides
        model_key(_Scaled(scale + 1).eval(), [x]),  # an embedded constant's value
        model_key(_Scaled(scale, act="silu").eval(), [x]),  # Python control flow
        model_key(_Scaled(scale, eps=1e-6).eval(), [x]),  # a scalar argument
        model_key(_Scaled(scale).double().eval(), [x.double()]),  # parameter dtypes
    ]
    assert None not in others
    assert len({key, *others}) == len(others) + 1


class _ReadsValues(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum() > 0 else x - 1


class _WritesBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(4))
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        self.seen.add_(1.0)
        F.relu(self.fc.weight, inplace=True)
        return self.fc(x) + self.seen


class _ReluInPlaceOnWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) + F.relu(self.fc.weight, True).sum()


def test_models_the_key_cannot_vouch_for_are_not_keyed_nor_changed():
    x = torch.randn(2, 4)
    assert model_key(_ReadsValues(), [x]) is None
    for model in (_WritesBuffer(), _ReluInPlaceOnWeight()):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        assert model_key(model, [x]) is None
        for name, t in model.state_dict().items():
            assert torch.equal(t, before[name]), name


def test_a_key_never_changes_the_inputs():
    x = torch.randn(2, 4)

    class AddsInPlace(nn.Module):
        def forward(self, t):
            t.add_(1.0)
            return t * 2

    copy = x.clone()
    assert model_key(AddsInPlace(), [x]) is not None
    assert torch.equal(x, copy)


def test_unreadable_entries_are_misses(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    torch.manual_seed(4)
    model, x = MLP((16, 8)).eval(), torch.randn(3, 16)
    _compile(model, x)
    (entry,) = (tmp_path / "exports").glob("*.zip")
    entry.write_bytes(b"not a zip")
    compiled = _compile(model, x)
    assert not compiled.report().export_cache_hit
    _check(compiled, model, torch.randn(3, 16))
    assert _compile(model, x).report().export_cache_hit  # rewritten by the miss


def test_cache_false_neither_reads_nor_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    model, x = MLP((16, 8)).eval(), torch.randn(3, 16)
    _compile(model, x, cache=False)
    assert not (tmp_path / "exports").exists()


def test_a_decode_step_hits_and_matches_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    torch.manual_seed(5)
    cfg = LlamaConfig(vocab=64, dim=32, layers=1, heads=2, kv_heads=1, hidden=48, max_seq=16)
    model = LlamaDecodeStep(Llama(cfg)).eval()
    token = torch.randint(0, cfg.vocab, (1, 1))
    _compile(model, token, *llama_cache(cfg, 1, 8))
    compiled = _compile(model, token, *llama_cache(cfg, 1, 8))
    assert compiled.report().export_cache_hit
    cache = llama_cache(cfg, 1, 8)
    with torch.no_grad():
        expected = model(token, *cache)
    torch.testing.assert_close(compiled(token, *cache), expected)


class _Pair(nn.Module):
    def forward(self, pair):
        a, b = pair
        return a * b


def test_nested_inputs_are_keyed_by_position_not_value():
    key = model_key(_Pair(), [(torch.randn(3), torch.randn(3))])
    assert key is not None
    assert model_key(_Pair(), [(torch.randn(3), torch.randn(3))]) == key
    assert model_key(_Pair(), [(torch.randn(4), torch.randn(4))]) not in (key, None)
    assert model_key(_Pair(), [[torch.randn(3), torch.randn(3)]]) not in (key, None)


def test_a_transformers_model_is_keyed_and_hits(tmp_path, monkeypatch):
    """transformers checks masks' values in eager but not under export: the key's run takes
    the export's branches, so such models get keys."""
    pytest.importorskip("transformers")
    from ember import hf_models

    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    model = hf_models.MainOutput(hf_models.build("llama")).eval()
    _compile(model, *hf_models.forward_inputs(2, 16))
    compiled = _compile(model, *hf_models.forward_inputs(2, 16))
    assert compiled.report().export_cache_hit
    ids, mask = hf_models.forward_inputs(2, 16)
    mask[0, :3] = 0  # other padding than the example's
    with torch.no_grad():
        expected = model(ids, mask)
    torch.testing.assert_close(compiled(ids, mask), expected, rtol=1e-4, atol=1e-4)


def test_torch_compile_graphs_hit_the_export_cache(tmp_path, monkeypatch):
    """Dynamo's graphs (weights passed as inputs, bound as attributes of a copy) are keyed
    and cached as ember.compile's models are."""
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    torch.manual_seed(6)
    x = torch.randn(4, 16)
    for weights in ("first", "second"):
        model = MLP((16, 24, 8)).eval()
        torch._dynamo.reset()
        fast = torch.compile(model, backend="ember")
        with torch.no_grad():
            out = fast(x)
            expected = model(x)
        torch.testing.assert_close(out, expected)
        assert ember.last_report().export_cache_hit == (weights == "second")
