"""The Python API: options, errors, fallback, ember.compile, compile_pt2, threads."""

import io
import threading
import warnings
import zipfile

import ember
import pytest
import torch
from conftest import Fn, check, rand


@torch.library.custom_op("ember_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@mystery.register_fake
def _(x):
    return torch.empty_like(x)


def uses_custom_op(x):
    return mystery(x + 1) - 1


def test_backend_is_registered_by_entry_point():
    assert "ember" in torch._dynamo.list_backends()


def test_unknown_option_names_valid_keys():
    with pytest.raises(
        ValueError,
        match="valid: allow_tf32, backend, cache, device, export, fallback, num_threads, quiet",
    ):
        ember.compile(torch.nn.Linear(2, 2), rand(1, 2), speed="max")


def test_option_of_wrong_type():
    with pytest.raises(TypeError, match="num_threads"):
        ember.compile(torch.nn.Linear(2, 2), rand(1, 2), num_threads="4")
    with pytest.raises(ValueError, match="fallback"):
        ember.compile(torch.nn.Linear(2, 2), rand(1, 2), fallback="maybe")


def test_unsupported_op_raises_naming_op_and_node():
    with pytest.raises(ember.UnsupportedOpError, match="ember_test.mystery") as info:
        ember.compile(Fn(uses_custom_op), rand(3))
    assert "node" in str(info.value)
    compiled = torch.compile(Fn(uses_custom_op), backend="ember", options={"fallback": "error"})
    with pytest.raises(ember.UnsupportedOpError, match="mystery"):
        compiled(rand(3))


def test_unsupported_op_falls_back_with_one_warning():
    compiled = torch.compile(Fn(uses_custom_op), backend="ember")
    x = rand(4)
    with pytest.warns(UserWarning, match="mystery"):
        out = compiled(x)
    torch.testing.assert_close(out, uses_custom_op(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(compiled(x), uses_custom_op(x))


def test_ember_compile_nested_inputs_and_outputs():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, pair, scale):
            a, b = pair
            return {"sum": self.lin(a + b) * scale, "diff": (a - b, b)}

    m = M().eval()
    args = ((rand(2, 4), rand(2, 4)), rand(1))
    fast = ember.compile(m, *args)
    torch.testing.assert_close(fast(*args), m(*args))
    new = ((rand(2, 4), rand(2, 4)), rand(1))
    torch.testing.assert_close(fast(*new), m(*new))


def test_compile_takes_plain_functions():
    w = rand(4, 3)

    def gelu_proj(x, y):
        return torch.nn.functional.gelu(x @ w) + y

    args = (rand(2, 4), rand(2, 3))
    fast = ember.compile(gelu_proj, *args)
    torch.testing.assert_close(fast(*args), gelu_proj(*args))
    fast = ember.compile(lambda x: x.softmax(-1) * 2, args[0])
    torch.testing.assert_close(fast(args[0]), args[0].softmax(-1) * 2)
    with pytest.raises(TypeError, match="nn.Module or a function, not int"):
        ember.compile(3, args[0])


def test_weights_are_bound_not_copied():
    lin = torch.nn.Linear(3, 3).eval()
    fast = ember.compile(lin, rand(2, 3))
    x = rand(2, 3)
    with torch.no_grad():
        lin.weight.mul_(2)  # in-place updates are seen: the weight is bound by pointer
    torch.testing.assert_close(fast(x), lin(x))


def test_wrong_input_shape_and_dtype_raise_input_error():
    fast = ember.compile(torch.nn.Linear(4, 2), rand(3, 4))
    with pytest.raises(ember.InputError, match="shape"):
        fast(rand(3, 5))
    with pytest.raises(ember.InputError, match="float64|float32"):
        fast(rand(3, 4, dtype=torch.float64))
    with pytest.raises(ember.InputError, match="expected 1"):
        fast.run_flat([rand(3, 4), rand(3, 4)])


def test_inputs_a_cpu_program_cannot_read_raise_input_error():
    """The fast path that reads inputs hands anything unusual to the checks that name it."""
    lin = torch.nn.Linear(4, 2).eval()
    fast = ember.compile(lin, rand(3, 4))
    with pytest.raises(ember.InputError, match="must be a tensor"):
        fast.run_flat([[1.0, 2.0, 3.0, 4.0]])
    with pytest.raises(ember.InputError, match="sparse_coo.*dense"):
        fast(rand(3, 4).to_sparse())
    with pytest.raises(ember.InputError, match="meta"):
        fast(torch.empty(3, 4, device="meta"))
    with pytest.raises(ember.InputError, match="complex64"):
        fast(torch.zeros(3, 4, dtype=torch.complex64))
    # The same program still runs on a good input afterwards.
    x = rand(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), lin(x))


def test_compile_pt2_archive(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.Linear(5, 2))
    x = rand(3, 6)
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(model, (x,)), path)
    fast = ember.compile_pt2(path)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-5)
    assert fast.input_names == ["input"]


def test_compile_pt2_returns_every_output(tmp_path):
    """An archive carries no output structure Ember reads: several outputs come back as a
    tuple in the program's order, not just the first."""

    class TwoOutputs(torch.nn.Module):
        def forward(self, a, b):
            return a * 2, b + 1

    model, a, b = TwoOutputs(), rand(1, 6, 2), rand(1, 6, 3)
    path = tmp_path / "two.pt2"
    torch.export.save(torch.export.export(model, (a, b)), path)
    got = ember.compile_pt2(path)(a, b)
    assert isinstance(got, tuple) and len(got) == 2
    for g, w in zip(got, model(a, b), strict=True):
        torch.testing.assert_close(g, w)


def _archive_with(entries):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in entries.items():
            z.writestr(name, data)
    return buf.getvalue()


def test_compile_pt2_rejects_escaping_paths_and_garbage(tmp_path):
    bad = tmp_path / "evil.pt2"
    bad.write_bytes(_archive_with({"m/models/model.json": "{}", "m/../../evil": "x"}))
    with pytest.raises(ember.CompileError, match="leaves the archive"):
        ember.compile_pt2(bad)
    junk = tmp_path / "junk.pt2"
    junk.write_bytes(b"definitely not a zip")
    with pytest.raises(ember.CompileError, match="not a zip"):
        ember.compile_pt2(junk)
    with pytest.raises(ember.CompileError, match="cannot open"):
        ember.compile_pt2(tmp_path / "missing.pt2")
    empty = tmp_path / "empty.pt2"
    empty.write_bytes(_archive_with({"m/models/model.json": '{"graph_module": 3}'}))
    with pytest.raises(ember.CompileError):
        ember.compile_pt2(empty)


def test_concurrent_calls_from_threads():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    fast = ember.compile(model.eval(), rand(4, 32))
    inputs = [rand(4, 32) for _ in range(8)]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
    results = [None] * len(inputs)

    def work(i):
        for _ in range(20):
            results[i] = fast(inputs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gather_index_out_of_range_is_an_error_not_a_crash():
    fast = ember.compile(
        Fn(lambda x, i: torch.gather(x, 1, i)), rand(2, 3), torch.zeros(2, 2, dtype=torch.int64)
    )
    with pytest.raises(ember.EmberError, match="index"):
        fast(rand(2, 3), torch.tensor([[0, 7], [1, 1]]))


def test_graph_break_still_correct():
    def fn(x):
        y = x.sin()
        print("", end="")  # forces a Dynamo graph break
        return y.cos() + 1

    check(fn, [rand(5)])


def test_ir_is_printable():
    fast = ember.compile(torch.nn.Linear(2, 2), rand(1, 2))
    assert "dot" in fast.ir()


def test_new_input_shapes_compile_again_correctly():
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh())
    compiled = torch.compile(model, backend="ember", options={"fallback": "error"})
    with torch.no_grad():
        for rows in (2, 7, 2, 1):
            x = rand(rows, 5)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_reference_backend_agrees_with_cpu_backend():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.SiLU(), torch.nn.LayerNorm(8))
    x = rand(3, 8)
    fast = ember.compile(model, x)
    ref = ember.compile(model, x, backend="reference")
    torch.testing.assert_close(fast(x), ref(x), rtol=1e-5, atol=1e-6)


class _ConvBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _randomize_bn(bn: torch.nn.BatchNorm2d) -> None:
    with torch.no_grad():
        bn.running_mean.copy_(rand(bn.num_features))
        bn.running_var.copy_(rand(bn.num_features).abs() + 0.5)


def test_torch_compile_binds_parameters_and_buffers_as_weights():
    """Dynamo passes parameters and buffers as graph inputs; Ember compiles them in as
    weights (so batch norm folds into the conv), and still sees in-place updates, replaced
    parameters, and another instance of the same class running through the same graph."""
    first, second = _ConvBlock().eval(), _ConvBlock().eval()
    _randomize_bn(first.bn)
    _randomize_bn(second.bn)
    x = rand(2, 3, 8, 8)
    with torch.no_grad():
        compiled = torch.compile(first, backend="ember", options={"fallback": "error"})
        torch.testing.assert_close(compiled(x), first(x))
        first.conv.weight.mul_(2)  # in place
        first.bn.running_var.add_(1)  # a buffer, in place
        torch.testing.assert_close(compiled(x), first(x))
        first.head.weight = torch.nn.Parameter(rand(4, 8))  # replaced
        torch.testing.assert_close(compiled(x), first(x))
        other = torch.compile(second, backend="ember", options={"fallback": "error"})
        for _ in range(2):  # alternating instances: each keeps its own weights
            torch.testing.assert_close(other(x), second(x))
            torch.testing.assert_close(compiled(x), first(x))
