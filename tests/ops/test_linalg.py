"""Matrix products: mm/bmm/addmm/linear/matmul with broadcasting, einsum contractions."""

import ember
import pytest
import torch
import torch.nn.functional as F
from conftest import check, host_options, rand

# Products accumulate in a different order than torch's GEMM: allow a few ulps per term.
TOL = {"rtol": 1e-5, "atol": 1e-5}

PRODUCTS = {
    "mm": (lambda a, b: a @ b, [(5, 7), (7, 3)]),
    "bmm": (lambda a, b: torch.bmm(a, b), [(2, 5, 7), (2, 7, 3)]),
    "matmul_broadcast": (lambda a, b: torch.matmul(a, b), [(2, 1, 5, 7), (3, 7, 4)]),
    "matmul_vec_mat": (lambda a, b: a @ b, [(7,), (7, 3)]),
    "matmul_mat_vec": (lambda a, b: a @ b, [(5, 7), (7,)]),
    "matmul_batched_vec": (lambda a, b: a @ b, [(2, 5, 7), (7,)]),
    "dot": (lambda a, b: torch.dot(a, b), [(9,), (9,)]),
    "matmul_3d_2d": (lambda a, b: a @ b, [(2, 5, 7), (7, 3)]),
    "transposed": (lambda a, b: a.t() @ b.transpose(0, 1), [(7, 5), (3, 7)]),
}


@pytest.mark.parametrize("name", sorted(PRODUCTS))
def test_products(name, backend):
    fn, shapes = PRODUCTS[name]
    check(fn, [rand(*s) for s in shapes], backend, **TOL, new_inputs=[rand(*s) for s in shapes])


def test_products_of_empty_sums(backend):
    """`k = 0`: every product is an empty sum (zeros), with a bias added after."""
    w, b = torch.zeros(6, 0), rand(6)

    def fn(a, x, c, d):
        return a @ torch.zeros(0, 5), torch.nn.functional.linear(x, w, b), torch.bmm(c, d)

    check(fn, [rand(4, 0), rand(3, 0), rand(2, 3, 0), rand(2, 0, 4)], backend, **TOL)


def test_addmm_and_baddbmm(backend):
    def fn(bias, a, b, c, d):
        return torch.addmm(bias, a, b, beta=0.5, alpha=2.0), torch.baddbmm(c, c, d)

    check(fn, [rand(3), rand(4, 5), rand(5, 3), rand(2, 4, 4), rand(2, 4, 4)], backend, **TOL)


def test_products_cast_to_another_type(backend):
    # A product whose only reader is a cast is not computed into the cast's buffer (it was,
    # and failed: "dot of float32 and float32 into int32").
    w = rand(6, 5)
    check(
        lambda x: ((x @ w * 4).to(torch.int32), (x @ w).double() + 1, (x @ w).to(torch.float16)),
        [rand(3, 6)],
        backend,
        **TOL,
    )


def test_int8_products(backend):
    # torch._int_mm: int8 × int8 summed exactly into int32 (`integer_dot`), with a weight
    # (prepared at compile time) and with a computed right operand, then a float epilogue.
    # Shapes CUDA's eager `_int_mm` accepts (M > 16, K and N multiples of 8).
    def i8(*shape: int) -> torch.Tensor:
        return rand(*shape, dtype=torch.int8, low=-128, high=127)

    w = i8(72, 24)

    def fn(a, b):
        return torch._int_mm(a, b), torch._int_mm(a, w).float() * 0.5 + 1

    check(fn, [i8(32, 72), i8(72, 40)], backend, new_inputs=[i8(32, 72), i8(72, 40)])


def test_linear_with_and_without_bias(backend):
    w, b = rand(6, 8), rand(6)
    check(lambda x: (F.linear(x, w, b), F.linear(x, w)), [rand(2, 3, 8)], backend, **TOL)


EINSUMS = {
    "bij,bjk->bik": [(2, 3, 4), (2, 4, 5)],
    "ij,kj->ik": [(3, 4), (5, 4)],
    "bhqd,bhkd->bhqk": [(2, 3, 4, 8), (2, 3, 5, 8)],
    "i,i->": [(6,), (6,)],
    "ij->ji": [(3, 4)],
    "ii->i": [(4, 4)],  # a diagonal
    "bii->b": [(2, 3, 3)],  # a batched trace
}


def test_diagonal(backend):
    check(
        lambda x: (
            torch.diagonal(x),
            torch.diagonal(x, offset=2, dim1=1, dim2=2),
            torch.diagonal(x, offset=-1, dim1=-1, dim2=0),
            x.diagonal(offset=9),  # past the edge: empty
        ),
        [rand(3, 4, 6)],
        backend,
    )


@pytest.mark.parametrize("eq", sorted(EINSUMS))
def test_einsum(eq, backend):
    check(lambda *xs: torch.einsum(eq, *xs), [rand(*s) for s in EINSUMS[eq]], backend, **TOL)


def test_f16_and_f64_matmul(backend):
    check(
        lambda a, b: a @ b,
        [rand(4, 16, dtype=torch.float64), rand(16, 3, dtype=torch.float64)],
        backend,
    )
    torch._dynamo.reset()
    a, b = (
        rand(4, 16, dtype=torch.float16, low=-1, high=1),
        rand(16, 3, dtype=torch.float16, low=-1, high=1),
    )
    check(lambda a, b: a @ b, [a, b], backend, rtol=2e-3, atol=2e-3)


# (rows, in, out): register-tile edges (rows not a multiple of 6, columns not of 16), K
# blocks (in > 256), the matrix-vector shape, and products large enough to split across
# threads. Linear weights are packed once at compile time for the CPU's own GEMM.
LINEAR_SHAPES = [(1, 3, 17), (5, 300, 33), (13, 600, 100), (64, 256, 688), (37, 1030, 50)]


@pytest.mark.parametrize("rows,cin,cout", LINEAR_SHAPES)
def test_linear_packed_weight_shapes(rows, cin, cout, backend):
    layer = torch.nn.Linear(cin, cout)
    check(layer, [rand(rows, cin)], backend, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bias", [False, True])
def test_residual_connections_around_a_linear_layer(bias, dtype, backend):
    # x + linear(h) as a transformer writes it ([1, rows, d] activations; the CUDA backend
    # adds x as cuBLASLt's C), and the reshaped product returned as well.
    layer = torch.nn.Linear(48, 32, bias=bias).to(dtype)

    def fn(x, h):
        y = layer(h.reshape(-1, 48)).reshape(1, -1, 32)
        return x + y, layer(h)

    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else TOL
    args = [rand(1, 5, 32, dtype=dtype), rand(1, 5, 48, dtype=dtype)]
    check(fn, args, backend, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_after_a_linear_layer(approximate, dtype, backend):
    # GPT-2's MLP activation (tanh) is the CUDA backend's cuBLASLt GELU epilogue.
    layer = torch.nn.Linear(40, 24).to(dtype)
    fn = lambda x: F.gelu(layer(x), approximate=approximate)  # noqa: E731
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else TOL
    check(fn, [rand(6, 40, dtype=dtype)], backend, **tol)


def test_sum_of_two_linear_layers(backend):
    # Either product could take the other as cuBLASLt's C; exactly one may.
    w1, w2, b = rand(24, 16), rand(24, 12), rand(24)
    fn = lambda x, y: F.linear(x, w1) + F.linear(y, w2, b)  # noqa: E731
    check(fn, [rand(5, 16), rand(5, 12)], backend, **TOL)


def test_linear_on_a_transposed_input(backend):
    layer = torch.nn.Linear(300, 40)
    check(lambda x: layer(x.t()), [rand(300, 7)], backend, rtol=1e-5, atol=1e-4)


def test_one_row_products(backend):
    """The matrix-vector products of one-token decode, which the CPU computes by streaming
    the weight's rows unpacked: a `linear` with bias and GELU (threads split its 333
    outputs), tile edges (4 rows at a time), a one-row input whose K is strided, and a
    batched q·kᵀ."""
    layer = torch.nn.Linear(300, 333)
    w = rand(7, 45)

    def fn(x, y, q, k):
        return (
            F.gelu(layer(x)),
            F.linear(y[:, ::2], w),
            q @ k.transpose(-1, -2),
        )

    args = [rand(1, 300), rand(1, 90), rand(2, 4, 1, 32), rand(2, 4, 9, 32)]
    check(fn, args, backend, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_row_half_precision_products(dtype, backend):
    # bf16/f16 weights streamed as stored and widened in registers (the CPU converted the
    # whole weight to f32 on every call); sums in f32, one rounding at the end, as eager.
    layer = torch.nn.Linear(300, 333).to(dtype)

    def fn(x, q, k):
        return layer(x), q @ k.transpose(-1, -2)

    args = [
        rand(1, 300, dtype=dtype),
        rand(2, 4, 1, 40, dtype=dtype),
        rand(2, 4, 9, 40, dtype=dtype),
    ]
    check(fn, args, backend, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [2, 9, 37])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_multi_row_half_precision_products_with_weights(rows, dtype, backend):
    # Products of several rows pack their bf16/f16 weight in its own type (the tiles widen
    # it as they load it): a `linear` (weight read transposed) and `x @ w` (row-major), with
    # partial panels of columns and tiles of every row count.
    layer = torch.nn.Linear(300, 333).to(dtype)
    w = torch.nn.Parameter(rand(300, 70, dtype=dtype))

    def fn(x):
        return layer(x), x @ w

    check(fn, [rand(rows, 300, dtype=dtype)], backend, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_multi_row_half_precision_products_of_activations(dtype, backend):
    # Both operands computed per call (attention's scores and values, a broadcast batch): the
    # CPU reads the right one in place in its own type, its panels packed per task.
    # Scores of a few units: eager rounds them to 16 bits before its softmax, which on
    # scores of hundreds moves the probabilities by more than any tolerance.
    def fn(q, k, a, b):
        return (q @ k.transpose(-1, -2) * 40**-0.5).softmax(-1) @ k, a @ b

    args = [
        rand(2, 4, 9, 40, dtype=dtype, low=-1, high=1),
        rand(2, 4, 13, 40, dtype=dtype, low=-1, high=1),
        rand(2, 1, 7, 300, dtype=dtype),
        rand(3, 300, 37, dtype=dtype),
    ]
    check(fn, args, backend, rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_products_over_the_packing_budget_read_weights_in_place(dtype, backend, monkeypatch):
    # EMBER_CPU_PACK_MB=0 leaves the CPU no memory for packed copies of weights (a model near
    # the machine's memory): every product of several rows reads its weight where it lives,
    # transposed or not, and computes what the packed program would.
    monkeypatch.setenv("EMBER_CPU_PACK_MB", "0")
    layer = torch.nn.Linear(300, 333).to(dtype)
    w = torch.nn.Parameter(rand(300, 70, dtype=dtype))

    def fn(x):
        return layer(x), F.gelu(x @ w)

    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    check(fn, [rand(37, 300, dtype=dtype)], backend, **tol, new_inputs=[rand(5, 300, dtype=dtype)])


@pytest.mark.parametrize("value", ["2GB", "-1", "lots"])
def test_an_unreadable_packing_budget_is_an_error_naming_it(value, monkeypatch):
    # A budget the user set and the CPU cannot read is not silently replaced by the
    # default: the compile fails, naming the variable and the value.
    monkeypatch.setenv("EMBER_CPU_PACK_MB", value)
    with pytest.raises(ember.InputError, match=f"EMBER_CPU_PACK_MB={value}: expected"):
        ember.compile(torch.nn.Linear(8, 4), rand(3, 8), backend="cpu")


def test_one_row_linear_sees_in_place_weight_updates(backend):
    # The weight of a one-row product is read where it lives, not from a packed copy.
    opts = host_options(backend)
    layer = torch.nn.Linear(64, 24).eval()
    x = rand(1, 64)
    compiled = torch.compile(layer, backend="ember", options=opts)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-5)
        layer.weight.mul_(-2.0)
        torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-5)


def test_linear_sees_in_place_weight_updates(backend):
    opts = host_options(backend)
    layer = torch.nn.Linear(40, 24).eval()
    x = rand(9, 40)
    compiled = torch.compile(layer, backend="ember", options=opts)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-5)
        layer.weight.mul_(-2.0)  # the packed copy must follow
        torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-5)
