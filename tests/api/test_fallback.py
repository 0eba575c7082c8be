"""torch.compile graphs with ops Ember does not support: supported regions compiled by Ember,
the unsupported ops run eagerly, one warning naming them; Dynamo graph breaks."""

import warnings

import ember
import pytest
import torch
from conftest import rand
from ember.backend import live_programs, programs_compiled


@torch.library.custom_op("ember_fallback::triple", mutates_args=())
def triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@triple.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("ember_fallback::split_signs", mutates_args=())
def split_signs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.clamp(min=0), x.clamp(max=0)


@split_signs.register_fake
def _(x):
    return torch.empty_like(x), torch.empty_like(x)


class Sandwich(torch.nn.Module):
    """Supported layers around unsupported custom ops, with a two-output custom op."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(16, 32)
        self.second = torch.nn.Linear(32, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.first(x))
        h = triple(h)
        pos, neg = split_signs(self.second(h))
        return self.norm(pos - 0.5 * neg).softmax(-1), neg.sum(-1)


def _no_warnings(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args)


def test_unsupported_ops_run_eagerly_between_compiled_regions():
    torch.manual_seed(0)
    model = Sandwich().eval()
    compiled = torch.compile(model, backend="ember")
    x = rand(4, 16)
    before = programs_compiled()
    with pytest.warns(UserWarning) as caught:
        out = compiled(x)
    messages = [str(w.message) for w in caught if "ember" in str(w.message)]
    assert len(messages) == 1, messages
    assert "ember_fallback.triple" in messages[0] and "ember_fallback.split_signs" in messages[0]
    # Linear+gelu, Linear, and norm/softmax/sum after the two-output op: three regions.
    assert "3 compiled region" in messages[0]
    assert programs_compiled() - before == 3
    expected = model(x)
    torch.testing.assert_close(out, expected)

    # Same shapes: nothing compiled again, no second warning.
    y = rand(4, 16)
    torch.testing.assert_close(_no_warnings(compiled, y), model(y))
    assert programs_compiled() - before == 3

    # The regions hold the weights by pointer: in-place updates are seen.
    with torch.no_grad():
        model.first.weight.mul_(2)
        model.norm.bias.add_(1)
    torch.testing.assert_close(_no_warnings(compiled, y), model(y))


def test_a_region_ember_refuses_runs_eagerly_with_its_whole_output():
    """A region whose op Ember supports by name but refuses for its arguments (erfinv of
    float64) runs its own graph eagerly; its one output comes back whole (it once came back
    as its first element)."""

    def fn(x):
        return triple(torch.erfinv(x.double() * 0.5)).float() + 1

    compiled = torch.compile(fn, backend="ember")
    x = rand(5, low=-1, high=1)
    with pytest.warns(UserWarning, match="ember"):
        out = compiled(x)
    torch.testing.assert_close(out, fn(x))


def test_split_graph_inputs_are_not_mutated():
    model = Sandwich().eval()
    compiled = torch.compile(model, backend="ember")
    x = rand(3, 16)
    kept = x.clone()
    with pytest.warns(UserWarning, match="ember_fallback"):
        compiled(x)
    torch.testing.assert_close(x, kept, rtol=0, atol=0)


def test_split_graph_serves_new_sizes_without_recompiling_each():
    """Dynamic sizes: the regions are compiled with symbolic dims, so a run of new batch
    sizes compiles a bounded number of programs, not three per size."""
    model = Sandwich().eval()
    compiled = torch.compile(model, backend="ember", dynamic=True)
    before = programs_compiled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in (2, 3, 5, 7, 9, 11):
            x = rand(n, 16)
            torch.testing.assert_close(compiled(x), model(x))
    assert programs_compiled() - before <= 6


def test_input_mutation_around_unsupported_op_is_written_back():
    def step(cache, x):
        cache.add_(x)  # in-place update of the caller's tensor
        return triple(cache) + 1

    compiled = torch.compile(step, backend="ember")
    cache, x = rand(5), rand(5)
    expected_cache = cache.clone()
    expected = step(expected_cache, x)
    with pytest.warns(UserWarning, match="ember_fallback.triple"):
        out = compiled(cache, x)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(cache, expected_cache)


def test_only_unsupported_ops_runs_eagerly():
    compiled = torch.compile(lambda x: triple(x), backend="ember")
    x = rand(6)
    with pytest.warns(UserWarning, match="ember_fallback.triple"):
        torch.testing.assert_close(compiled(x), x * 3)


def test_argument_refusal_runs_whole_graph_eagerly_with_its_reason():
    """Every op is supported by name but one refuses its arguments (rounding to decimals):
    no regions, one warning naming the op."""
    compiled = torch.compile(lambda x: torch.round(x.exp(), decimals=2) * 2, backend="ember")
    x = rand(3, 100)
    with pytest.warns(UserWarning, match="round") as caught:
        out = compiled(x)
    assert len([w for w in caught if "ember" in str(w.message)]) == 1
    torch.testing.assert_close(out, torch.round(x.exp(), decimals=2) * 2)


def test_fallback_error_names_the_ops():
    compiled = torch.compile(Sandwich().eval(), backend="ember", options={"fallback": "error"})
    with pytest.raises(ember.UnsupportedOpError, match="ember_fallback"):
        compiled(rand(2, 16))


def test_graph_breaks_just_work():
    """Dynamo splits at a data-dependent branch and a print; each graph is Ember's."""

    def fn(x):
        y = torch.relu(x) * 2
        if y.sum() > 0:  # graph break: depends on data
            y = y + 1
        else:
            y = y - 1
        print("", end="")  # graph break: side effect
        return torch.tanh(y).softmax(-1)

    compiled = torch.compile(fn, backend="ember", options={"fallback": "error"})
    before = programs_compiled()
    live = live_programs()  # held, so no new program can take an old one's id
    for x in (rand(3, 8), -rand(3, 8).abs()):
        torch.testing.assert_close(_no_warnings(compiled, x), fn(x))
    assert programs_compiled() - before >= 2
    # Each graph's program can be asked how its runs went (what bench/gpu_llama.py prints).
    built = [p for p in live_programs() if all(p is not q for q in live)]
    assert len(built) == programs_compiled() - before
    assert all(p.device == "cpu" and "%" in p.ir() for p in built)
