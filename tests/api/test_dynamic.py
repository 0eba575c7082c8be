"""Dynamic shapes through torch.compile: once Dynamo marks a dim dynamic, one symbolic Ember
program serves every size — a growing decode loop does not recompile per step."""

from typing import Any

import ember
import pytest
import torch
from conftest import rand
from ember.backend import programs_compiled
from ember.models import Llama, LlamaConfig, LlamaDecodeStep, llama_cache

SMALL = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, max_seq=64)


def test_batch_size_changes_compile_one_symbolic_program():
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.Linear(5, 3))
    compiled = torch.compile(model, backend="ember", options={"fallback": "error"})
    before = programs_compiled()
    with torch.no_grad():
        for rows in (2, 7, 9, 16, 33, 4):
            x = rand(rows, 6)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    # One static program for the first size, one symbolic program for all the others.
    assert programs_compiled() - before == 2


def test_sizes_that_shrink_and_grow_again_reuse_buffers_correctly():
    # The CPU runtime keeps each call's intermediate buffers for the next call; buffers of a
    # larger earlier call must not leak stale values into a smaller one, and back.
    def f(x):
        h = torch.cat([x, x * 2.0], dim=1).softmax(dim=1)
        return torch.nn.functional.layer_norm(h + 1.0, (h.shape[-1],)) + x.sum(1, keepdim=True)

    compiled = torch.compile(f, backend="ember", options={"fallback": "error"})
    with torch.no_grad():
        for rows in (3, 40, 5, 40, 64, 2, 64, 2):
            x = rand(rows, 24)
            torch.testing.assert_close(compiled(x), f(x), rtol=1e-4, atol=1e-4)


def test_decode_loop_with_growing_kv_cache_does_not_recompile_per_token():
    step = LlamaDecodeStep(Llama(SMALL)).eval()
    compiled = torch.compile(step, backend="ember", options={"fallback": "error"})
    cache = llama_cache(SMALL, 1, 4)
    before = programs_compiled()
    with torch.no_grad():
        for _ in range(8):
            token = torch.randint(0, SMALL.vocab, (1, 1))
            got = compiled(token, *cache)
            want = step(token, *cache)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            cache = list(want[1:])
    # Dynamo passes the cache length as an int input of its own; Ember reads it from the
    # cache's shape instead, so one static program (first size) and one symbolic program.
    assert programs_compiled() - before <= 2


class _Cache:
    """A cache object as transformers keeps them: tensors plus a Python int length."""

    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys
        self.length = keys.shape[1]


def _append(x: torch.Tensor, cache: _Cache) -> torch.Tensor:
    cache.keys = torch.cat([cache.keys, x], dim=1)
    cache.length += x.shape[1]
    return (cache.keys * 0.5).softmax(1) * cache.keys.shape[1]


def test_graph_returning_a_size_keeps_one_program_as_the_size_grows():
    """Dynamo returns the cache's new length (an int computed from int inputs) next to the
    tensors; Ember computes it in Python and compiles one symbolic program."""
    compiled = torch.compile(_append, backend="ember", options={"fallback": "error"})
    ours, theirs = _Cache(rand(2, 3, 4)), _Cache(rand(2, 3, 4))
    theirs.keys = ours.keys.clone()
    before = programs_compiled()
    with torch.no_grad():
        for _ in range(8):
            x = rand(2, 1, 4)
            torch.testing.assert_close(compiled(x, ours), _append(x, theirs))
            assert ours.length == theirs.length
            assert isinstance(ours.length, int)
    assert ours.length == 3 + 8
    assert programs_compiled() - before <= 2


class _StaticCacheStep(torch.nn.Module):
    """Writes new keys into a preallocated cache in place (a static KV cache) and counts
    steps in a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, keys: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor):
        cache.index_copy_(1, pos, keys)
        self.steps += 1
        return (cache * 2).sum(1)


def test_in_place_updates_of_inputs_and_buffers_are_written_back():
    """Input and buffer mutations, through torch.compile and ember.compile, land in the
    caller's tensors as in eager."""
    for compile_with in ("torch.compile", "ember.compile"):
        model, reference = _StaticCacheStep(), _StaticCacheStep()
        ours, theirs = torch.zeros(2, 6, 3), torch.zeros(2, 6, 3)
        if compile_with == "torch.compile":
            compiled = torch.compile(model, backend="ember", options={"fallback": "error"})
        else:
            example = (rand(2, 1, 3), torch.tensor([0]), ours.clone())
            compiled = ember.compile(model, *example)
        with torch.no_grad():
            for step in range(4):
                keys, pos = rand(2, 1, 3), torch.tensor([step])
                got = compiled(keys, pos, ours)
                want = reference(keys, pos, theirs)
                torch.testing.assert_close(got, want)
                torch.testing.assert_close(ours, theirs)
        assert int(model.steps) == int(reference.steps) == 4, compile_with


def _count_and_report(x: torch.Tensor, steps: torch.Tensor):
    steps.add_(x.shape[0])
    return x * 2, steps.clone()


def test_an_updated_input_also_returned_is_right_in_both_places(backend):
    """The updated value is a program output twice (the update, and the returned clone):
    the second is copied from the first. On CUDA that copy read its own, unwritten output
    (a transformers StaticCache's `cumulative_length` came back as -1)."""
    if backend == "reference":
        pytest.skip("the reference interpreter returns new tensors only")
    device = "cuda" if backend == "cuda" else "cpu"
    options = {"device": "cuda"} if backend == "cuda" else {"backend": backend}
    compiled = torch.compile(
        _count_and_report, backend="ember", options={"fallback": "error", **options}
    )
    ours, theirs = torch.tensor(3, device=device), torch.tensor(3, device=device)
    with torch.no_grad():
        for rows in (5, 5):
            x = rand(rows, 4).to(device)
            got, want = compiled(x, ours), _count_and_report(x, theirs)
            torch.testing.assert_close(got, want)
            assert int(ours) == int(theirs)
    assert int(ours) == 13


def test_a_cache_update_is_written_into_the_callers_tensor_and_not_on_failure(backend):
    """An update of an input nothing else reads (a static KV cache's `index_copy_`) is
    written straight into the caller's tensor, with no second copy (`_in_place`), and
    counted as a change (`_version`); a call that fails on a bad index leaves it as it was.
    On CUDA (and its emulator) the program writes only the new rows, after checking every
    index of the call."""
    if backend == "reference":
        pytest.skip("the reference interpreter returns new tensors only")
    device = "cuda" if backend == "cuda" else "cpu"
    options = {"device": "cuda"} if backend == "cuda" else {"backend": backend}

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, device=device)

    def on(t: torch.Tensor) -> torch.Tensor:
        return t.to(device)

    model, reference = _StaticCacheStep().to(device), _StaticCacheStep().to(device)
    ours, theirs = zeros(2, 6, 3), zeros(2, 6, 3)
    example = (on(rand(2, 1, 3)), on(torch.tensor([0])), ours.clone())
    compiled = ember.compile(model, *example, **options)
    assert compiled._in_place == {1: 2}, compiled._in_place
    with torch.no_grad():
        for step in (0, 5, 2):
            keys, pos = on(rand(2, 1, 3)), on(torch.tensor([step]))
            version = ours._version
            torch.testing.assert_close(compiled(keys, pos, ours), reference(keys, pos, theirs))
            torch.testing.assert_close(ours, theirs)
            assert ours._version > version
        before = ours.clone()
        with pytest.raises(ember.EmberRuntimeError, match="out of range"):
            compiled(on(rand(2, 1, 3)), on(torch.tensor([6])), ours)
        torch.testing.assert_close(ours, before, rtol=0, atol=0)
        # A cache that is not contiguous (a view into a larger tensor) cannot be an output
        # buffer: it is updated by a copy, as before.
        wide, theirs_wide = zeros(2, 12, 3), zeros(2, 12, 3)
        keys, pos = on(rand(2, 1, 3)), on(torch.tensor([4]))
        got = compiled(keys, pos, wide[:, :6])
        torch.testing.assert_close(got, reference(keys, pos, theirs_wide[:, :6]))
        torch.testing.assert_close(wide, theirs_wide)


def test_graph_returning_the_size_of_an_intermediate():
    """A returned size of a tensor the graph computes (Dynamo writes it in terms of the
    input's size) comes back as a Python int, with one symbolic program."""

    def fn(x):
        y = torch.cat([x, x * 2], dim=0)
        return y.softmax(0), y.shape[0] + 1

    compiled = torch.compile(fn, backend="ember", dynamic=True, options={"fallback": "error"})
    before = programs_compiled()
    with torch.no_grad():
        for rows in (3, 5, 9):
            x = rand(rows, 4)
            got, want = compiled(x), fn(x)
            torch.testing.assert_close(got[0], want[0])
            assert got[1] == want[1] and isinstance(got[1], int)
    assert programs_compiled() - before == 1


def test_dynamic_true_with_float_module_attributes():
    """With ``dynamic=True`` Dynamo passes a norm's ``eps`` (a Python float attribute) as a
    0-d tensor read by ``.item()``; Ember specializes on its value: one program for every
    batch size, and another ``eps`` gets its own."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)).eval()
    compiled = torch.compile(model, backend="ember", dynamic=True, options={"fallback": "error"})
    before = programs_compiled()
    with torch.no_grad():
        for rows in (2, 3, 5):
            x = rand(rows, 16)
            torch.testing.assert_close(compiled(x), model(x))
        assert programs_compiled() - before == 1
        model[1].eps = 0.5  # a changed attribute: Dynamo passes the new value
        x = rand(4, 16)
        torch.testing.assert_close(compiled(x), model(x))


class _SelfMixer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x):
        h = self.norm(self.proj(x))
        return (h @ h.transpose(1, 2) / 4).softmax(-1) @ h


def test_export_dims_become_symbols_of_one_program(tmp_path):
    """A program exported with ``torch.export.Dim``s, saved, and compiled once by
    ``ember.compile_pt2`` serves every size in the dims' ranges."""
    model = _SelfMixer().eval()
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=2, max=64)
    with torch.no_grad():
        ep = torch.export.export(model, (rand(2, 5, 16),), dynamic_shapes=({0: batch, 1: seq},))
    path = tmp_path / "mixer.pt2"
    torch.export.save(ep, path)
    compiled = ember.compile_pt2(path)
    with torch.no_grad():
        for shape in ((1, 2), (2, 5), (3, 17), (8, 64)):
            x = rand(*shape, 16)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    with pytest.raises(ember.InputError):
        compiled(rand(9, 4, 16))  # outside the exported range


def test_dims_dynamo_gives_one_symbol_are_exported_as_one_dim():
    """A decode step's key and value caches share Dynamo's length symbol: they must stay one
    symbol through export (each its own ``Dim.AUTO`` let export pin one of them to its
    example size: a program per cache length), within the range Dynamo's guards leave."""
    from ember.export import dynamo_dynamic_shapes

    specs: list[Any] = []

    def capture(gm: torch.fx.GraphModule, args: list[Any]) -> Any:
        specs.append((dynamo_dynamic_shapes(gm, args), dynamo_dynamic_shapes(gm, args, tied=False)))
        return gm

    step = LlamaDecodeStep(Llama(SMALL)).eval()
    compiled = torch.compile(step, backend=capture, dynamic=True)
    with torch.no_grad():
        compiled(torch.randint(0, SMALL.vocab, (1, 1)), *llama_cache(SMALL, 1, 13))
    (tied, untied) = specs[0]
    cache_dims = [d[2] for d in tied if isinstance(d, dict) and 2 in d]
    assert len(cache_dims) == 2 * SMALL.layers
    assert all(d is cache_dims[0] for d in cache_dims), "one Dim for every cache's length"
    # Dynamo's guard from the rotary table's slice (`pos + 1 <= max_seq`) is its range.
    assert cache_dims[0].max == SMALL.max_seq - 1
    # Untied: each its own AUTO hint; no dim Dynamo pinned to a number is marked.
    untied_dims = [d for d in untied if isinstance(d, dict)]
    assert all(len(d) == 1 and 2 in d for d in untied_dims)
