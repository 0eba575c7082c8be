"""Shared test helpers: the user workflow (module → torch.compile(backend="ember") →
assert_close against eager), run on every backend Ember has."""

from __future__ import annotations

import contextlib
import copy
import os
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ember
import numpy as np
import pytest
import torch
from ember.backend import programs_compiled

# Op tests run on every backend: "cuda-emu" is the CUDA backend's generated kernels run on
# the host, "cuda" the GPU (marked `cuda`, skipped without one). EMBER_TEST_BACKENDS=cpu
# (say) narrows them to one.
_DEFAULT_BACKENDS = "cpu,reference" + (",cuda-emu,cuda" if ember.cuda.cuda_built() else "")
BACKENDS = [
    pytest.param(
        b,
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not ember.cuda_available(), reason="needs an NVIDIA GPU"),
        ],
    )
    if b == "cuda"
    else b
    for b in os.environ.get("EMBER_TEST_BACKENDS", _DEFAULT_BACKENDS).split(",")
]


@pytest.fixture(autouse=True, scope="session")
def _private_compile_cache(tmp_path_factory):
    """The optimizer's compile cache lives in a fresh folder per test session: results never
    depend on what an earlier run (or an older Ember) left in the user's cache."""
    old = os.environ.get("EMBER_CACHE_DIR")
    os.environ["EMBER_CACHE_DIR"] = str(tmp_path_factory.mktemp("ember-cache"))
    yield
    if old is None:
        os.environ.pop("EMBER_CACHE_DIR", None)
    else:
        os.environ["EMBER_CACHE_DIR"] = old


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts with empty Dynamo caches, so no test hits the recompile limit and
    silently runs eagerly."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


# The backend the ONNX tests' `onnx_util.check` compiles for when not handed a runner.
CHECK_ON = {"backend": "cpu"}


@pytest.fixture(
    params=[
        pytest.param(b, marks=pytest.mark.slow) if b == "cuda-emu" else b
        for b in BACKENDS
        if b != "reference"
    ]
)
def check_backend(request) -> Iterator[str]:
    """Runs an ONNX test whose models go through `onnx_util.check` on the CPU, on the GPU
    where there is one, and on the emulated CUDA backend in slow runs."""
    CHECK_ON["backend"] = request.param
    try:
        yield request.param
    finally:
        CHECK_ON["backend"] = "cpu"


class Fn(torch.nn.Module):
    """Wraps a function as a module."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def _moved(value: Any, device: str) -> Any:
    """`value` on `device`: a tensor, a module (a copy: other tests may share it), or a tuple
    or list of them; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, torch.nn.Module):
        return copy.deepcopy(value).to(device)
    if isinstance(value, tuple | list):
        return type(value)(_moved(v, device) for v in value)
    return value


def _function_on(fn: Callable[..., Any], device: str) -> Callable[..., Any]:
    """`fn` with the tensors it captured (closure cells, default arguments) on `device`: op
    tests write `lambda x: F.linear(x, w, b)` with `w` and `b` made on the host."""
    if not isinstance(fn, types.FunctionType):
        return fn
    cells = None
    if fn.__closure__ is not None:
        cells = []
        for cell in fn.__closure__:
            try:
                cells.append(types.CellType(_moved(cell.cell_contents, device)))
            except ValueError:  # a cell not yet filled (a name bound later)
                cells.append(cell)
        cells = tuple(cells)
    defaults = _moved(fn.__defaults__, device) if fn.__defaults__ is not None else None
    moved = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, defaults, cells)
    moved.__kwdefaults__ = fn.__kwdefaults__
    return moved


def _on_device(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """A copy of `model` on `device`, with what its wrapped functions captured there too."""
    model = copy.deepcopy(model).to(device)
    for m in model.modules():
        if isinstance(m, Fn):
            m.fn = _function_on(m.fn, device)
    return model


@contextlib.contextmanager
def _cuda_reference() -> Iterator[None]:
    """Eager on the GPU as the reference: tensors the model makes (torch.zeros(...) with no
    device) land on the GPU, and cuDNN convolutions run in full f32 (torch's default lets
    them round operands to TF32, which Ember does only when asked: allow_tf32=True)."""
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.device("cuda"):
            yield
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


def _clone(args: Sequence[Any]) -> list[Any]:
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def check(
    model: torch.nn.Module | Callable[..., Any],
    inputs: Sequence[Any],
    backend: str = "cpu",
    rtol: float = 1.3e-6,
    atol: float = 1e-5,
    new_inputs: Sequence[Any] | None = None,
) -> Any:
    """Compiles ``model`` with torch.compile(backend="ember"), checks it against eager on
    ``inputs`` and again on ``new_inputs`` (a second call with new values), and checks that
    inputs are not modified. Returns the compiled callable."""
    if not isinstance(model, torch.nn.Module):
        model = Fn(model)
    model.eval()
    options = {"backend": backend, "fallback": "error"}
    on_device: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
    if backend == "cuda":
        # The same model and inputs on the GPU, against eager on the GPU; GPU math
        # (exp, tanh, reduction order) differs from the CPU's in the last bits.
        model = _on_device(model, "cuda")
        on_device = _cuda_reference
        inputs = _moved(list(inputs), "cuda")
        new_inputs = _moved(list(new_inputs), "cuda") if new_inputs is not None else None
        options = {"device": "cuda", "fallback": "error"}
        rtol, atol = max(rtol, 1e-4), max(atol, 1e-4)
    before = programs_compiled()
    compiled = torch.compile(model, backend="ember", options=options)
    for args in [inputs] + ([new_inputs] if new_inputs is not None else []):
        pristine = _clone(args)
        with torch.no_grad():
            with on_device():  # the reference only: Dynamo traces without the device mode
                expected = model(*_clone(args))
            got = compiled(*args)
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, equal_nan=True)
        for a, p in zip(args, pristine, strict=True):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, p) or (a.isnan() == p.isnan()).all(), "input modified"
    assert programs_compiled() > before, "Ember did not compile this graph"
    return compiled


def host_options(backend: str) -> dict[str, Any]:
    """Options for a test that drives torch.compile itself on cpu tensors (sizes, errors);
    `check` runs the same ops on the GPU, so such a test skips the "cuda" backend."""
    if backend == "cuda":
        pytest.skip("a host-tensor test; check() covers this op on cuda")
    return {"backend": backend, "fallback": "error"}


def rand(*shape: int, dtype: torch.dtype = torch.float32, low: float = -3, high: float = 3):
    if dtype.is_floating_point:
        return (torch.rand(shape) * (high - low) + low).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    return torch.randint(int(low), int(high) + 1, shape, dtype=dtype)


__all__ = ["BACKENDS", "Fn", "check", "ember", "host_options", "onnx_mlp", "rand"]


def onnx_mlp() -> tuple[bytes, np.ndarray]:
    """A two-layer ONNX MLP with a dynamic row count "n" (MatMul, Add, Relu, initializers)
    and an input for it."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1, b1 = rng.standard_normal((16, 32), np.float32), rng.standard_normal(32, np.float32)
    w2 = rng.standard_normal((32, 8), np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
        [numpy_helper.from_array(a, name) for a, name in ((w1, "w1"), (b1, "b1"), (w2, "w2"))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8  # what every onnxruntime reads (a newer onnx writes a newer one)
    return model.SerializeToString(), rng.standard_normal((5, 16), np.float32)
