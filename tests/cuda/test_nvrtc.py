"""The CUDA code generator without a GPU: every kernel the test models generate compiles
under NVRTC (torch's libnvrtc) for real architectures, and the same kernels, run on the host
by the emulator, match eager PyTorch."""

from __future__ import annotations

from typing import Any

import ember
import numpy as np
import pytest
import torch
from conftest import check, rand
from ember import _core, cuda
from ember.export import export_program, save_bytes
from ember.models import MLP, Llama, LlamaConfig, LlamaDecodeStep, MobileNet, ResNet, llama_cache

PRODUCT_CHOICES = ("cuda.warp_dot", "cuda.thread_dot")
MMA = "cuda.mma_attention"
SMALL = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, max_seq=32)

pytestmark = pytest.mark.skipif(not cuda.cuda_built(), reason="built without the CUDA backend")


def _ops_model(dtype: torch.dtype):
    def fn(x, idx):
        y = torch.nn.functional.layer_norm(x, x.shape[-1:]) * 2 + 1
        s = torch.softmax(y, dim=-1).log_softmax(dim=0)
        g = torch.gather(x, 1, idx)
        c = torch.cat([x.flip(0), x[:, ::2]], dim=1)
        m = x.amax(dim=1), x.argmin(dim=0), x.cumsum(dim=1)
        return s, g, c, m, torch.nn.functional.pad(x, (1, 2)).sum(), x.to(dtype).exp()

    return fn


def _routing_model(dtype: torch.dtype):
    """A mixture-of-experts layer's routing: top-2 experts, tokens sorted by expert, tokens
    per expert, and the grouped product."""

    def fn(x, logits, w):
        _, experts = logits.topk(2, dim=-1)
        ids, order = experts.reshape(-1).sort()
        counts = torch.histc(ids.float(), bins=w.shape[0], min=0, max=w.shape[0] - 1)
        ends = counts.cumsum(0).to(torch.int32)
        rows = x[order // 2].to(dtype)
        return torch.nn.functional.grouped_mm(rows, w.to(dtype), offs=ends), x.argsort(dim=0)

    return fn


def _attention_model(q, k, v, keep, bias):
    """Prefill attention of grouped-query heads: causal, a boolean and an additive mask."""
    kg, vg = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return (
        sdpa(q, kg, vg, is_causal=True),
        sdpa(q, kg, vg, attn_mask=keep),
        sdpa(q, kg, vg, attn_mask=bias),
    )


def _attention_args(dtype: torch.dtype) -> list[torch.Tensor]:
    return [
        rand(1, 4, 40, 64).to(dtype),
        rand(1, 2, 45, 64).to(dtype),
        rand(1, 2, 45, 64).to(dtype),
        torch.rand(1, 1, 40, 45) > 0.3,
        rand(1, 1, 40, 45).to(dtype),
    ]


def _static_cache_model(keys, pos, cache, ids, table):
    """A static cache's update in place (a scatter into an input, its indices checked
    before the write) and a later lookup whose indices that check covers too."""
    cache.index_copy_(1, pos, keys)
    return (cache * 2).sum(1) + table[ids]


def _models() -> list[tuple[str, torch.nn.Module, list[torch.Tensor]]]:
    torch.manual_seed(0)
    step = LlamaDecodeStep(Llama(SMALL)).eval()
    return [
        ("mlp", MLP((16, 32, 32, 8)).eval(), [rand(4, 16)]),
        ("llama", Llama(SMALL).eval(), [torch.randint(0, SMALL.vocab, (2, 9))]),
        (
            "decode",
            step,
            [torch.randint(0, SMALL.vocab, (1, 1)), *llama_cache(SMALL, 1, 4)],
        ),
        ("resnet", ResNet(widths=(8, 16), classes=5).eval(), [rand(1, 3, 16, 16)]),
        ("mobilenet", MobileNet(classes=5).eval(), [rand(1, 3, 16, 16)]),
    ]


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _sources() -> dict[str, dict]:
    out = {}
    cases = _models() + [
        (
            f"ops_{dt}",
            _Fn(_ops_model(dt)),
            [rand(5, 7), torch.randint(0, 7, (5, 4))],
        )
        for dt in (torch.float16, torch.bfloat16, torch.float64)
    ]
    cases += [
        (
            f"routing_{dt}",
            _Fn(_routing_model(dt)),
            [rand(6, 8), rand(6, 4), rand(4, 8, 16)],
        )
        for dt in (torch.float32, torch.bfloat16)
    ]
    cases += [
        (f"attention_{dt}", _Fn(_attention_model), _attention_args(dt))
        for dt in (torch.float16, torch.bfloat16)
    ]
    cases.append(
        (
            "static_cache",
            _Fn(_static_cache_model),
            [rand(2, 1, 3), torch.tensor([1]), rand(2, 6, 3), torch.tensor([0, 2]), rand(4, 3)],
        )
    )
    # An int8 product (`integer_dot`) and its float epilogue.
    cases.append(
        (
            "int8_product",
            _Fn(lambda a, b: torch._int_mm(a, b).float() * 0.5),
            [rand(32, 64).to(torch.int8), rand(64, 24).to(torch.int8)],
        )
    )
    # An int4 product whose weight stays packed (ONNX Runtime's `MatMulNBits`).
    out["int4_product"] = cuda.generated_source(_core.load_onnx(data=_int4_model()))
    # GroupQueryAttention appending to a cache (`cache_append`) with per-sequence lengths.
    out["gqa_cache"] = cuda.generated_source(_core.load_onnx(data=_gqa_model()))
    for name, model, args in cases:
        ep = export_program(model, args)
        program = _core.load_pt2(data=save_bytes(ep), load_weights=False)
        out[name] = cuda.generated_source(program)
        if name in ("llama", "decode"):
            # What `torch.compile(dynamic=True)` runs: the sequence or cache length symbolic.
            out[f"{name}_dynamic"] = cuda.generated_source(_dynamic_program(name, model, args))
        if name in ("mlp", "llama", "decode"):
            # The product kernels the optimizer may choose instead of cuBLASLt.
            for choice in PRODUCT_CHOICES:
                out[f"{name}+{choice}"] = cuda.generated_source(program, choice)
        if name.startswith("attention"):
            # Tensor-core attention, the backends' default on sm_80 and newer.
            out[f"{name}+{MMA}"] = cuda.generated_source(program, MMA)
    return out


def _int4_model() -> bytes:
    """One `MatMulNBits` (4 bits, blocks of 32, packed zero points) on rows of any count."""
    from onnx import TensorProto, helper, numpy_helper

    n, k, block = 24, 64, 32
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (n, k // block, block // 2), generator=g, dtype=torch.uint8)
    zeros = torch.randint(0, 256, (n, 1), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // block, generator=g) * 0.1
    node = helper.make_node(
        "MatMulNBits",
        ["a", "b", "scales", "zeros"],
        ["y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=4,
        block_size=block,
    )
    graph = helper.make_graph(
        [node],
        "int4",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["rows", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])],
        [
            numpy_helper.from_array(t.numpy(), name)
            for name, t in (("b", packed), ("scales", scales), ("zeros", zeros))
        ],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def _gqa_model() -> bytes:
    """One decode step of `GroupQueryAttention`: 4 query and 2 key/value heads of 8, a
    past of 5 positions, 6 in all."""
    from onnx import TensorProto, helper, numpy_helper

    heads, kv, head, past, total = 4, 2, 8, 5, 6
    node = helper.make_node(
        "GroupQueryAttention",
        ["q", "k", "v", "past_key", "past_value", "seqlens_k", "total"],
        ["y", "present_key", "present_value"],
        domain="com.microsoft",
        num_heads=heads,
        kv_num_heads=kv,
    )
    f = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("q", f, ["batch", 1, heads * head]),
        helper.make_tensor_value_info("k", f, ["batch", 1, kv * head]),
        helper.make_tensor_value_info("v", f, ["batch", 1, kv * head]),
        helper.make_tensor_value_info("past_key", f, ["batch", kv, past, head]),
        helper.make_tensor_value_info("past_value", f, ["batch", kv, past, head]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
    ]
    outputs = [
        helper.make_tensor_value_info("y", f, ["batch", 1, heads * head]),
        helper.make_tensor_value_info("present_key", f, ["batch", kv, total, head]),
        helper.make_tensor_value_info("present_value", f, ["batch", kv, total, head]),
    ]
    graph = helper.make_graph(
        [node],
        "gqa",
        inputs,
        outputs,
        [numpy_helper.from_array(np.array(total, np.int32), "total")],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def _dynamic_program(name: str, model: torch.nn.Module, args: list[torch.Tensor]) -> Any:
    """`model` exported with its sequence (prefill) or cache (decode) length symbolic."""
    length = torch.export.Dim("length", min=2, max=SMALL.max_seq - 2)
    if name == "decode":
        dynamic: Any = (None, tuple({2: length} for _ in args[1:]))
    else:
        dynamic = ({1: length},)
    ep = export_program(model, args, dynamic_shapes=dynamic)
    return _core.load_pt2(data=save_bytes(ep), load_weights=False)


@pytest.mark.nvrtc
def test_every_generated_kernel_compiles_with_nvrtc():
    if cuda.nvrtc_version() is None:
        pytest.skip("libnvrtc not found (install the CUDA build of torch)")
    sources = _sources()
    distinct = set()
    for name, gen in sources.items():
        for arch in ("sm_80", "sm_90"):
            size = cuda.nvrtc_compile(gen["source"], arch)
            assert size > 0, f"{name}: empty CUBIN for {arch}"
        distinct |= {(name, k) for k in gen["kernels"]}
        # Each kernel is defined once in its translation unit.
        for k in gen["kernels"]:
            assert gen["source"].count(f" {k}(") == 1, f"{name}: kernel {k} defined twice"
    assert len(distinct) >= 10, f"only {len(distinct)} kernels generated"
    # The int4 product is one launch reading the packed bytes (no float weight made first).
    int4 = sources["int4_product"]
    assert int4["steps"] == 1 and "const unsigned char* __restrict__" in int4["source"]
    # The cache's update is gated on the check of every index that runs before it.
    assert "if (meta[0] != 0) return;" in sources["static_cache"]["source"]
    for choice in PRODUCT_CHOICES:
        base, chosen = sources["decode"], sources[f"decode+{choice}"]
        assert chosen["source"] != base["source"], f"{choice} changed nothing"
    for dt in (torch.float16, torch.bfloat16):
        mma = sources[f"attention_{dt}+{MMA}"]["source"]
        assert "mma.sync.aligned.m16n8k16" in mma and "ember_mma_" in mma.split("ember_pack2")[-1]


# Launches of one decode layer: rms norm (warp_dot: none, each warp of the next products
# normalizes its row); q, k, v products (cuBLASLt: 3; warp_dot: 1 kernel for all three);
# the k and v cache concats, k's rotary embedding computed in place (1 kernel); split
# attention (1 kernel; q's rotary embedding computed inside, each row's last block
# combining the chunks); o product (+ residual);
# rms norm (warp_dot: none); gate, up (cuBLASLt: 2 products and silu(gate) * up;
# warp_dot: 1 kernel for all three); down product (+ residual). Around the layers: the
# embedding gather, the final norm (warp_dot: none), the logits product.
DECODE_STEPS = {None: 2 * 12 + 3, "cuda.warp_dot": 2 * 6 + 2}


@pytest.mark.parametrize("choice", list(DECODE_STEPS))
def test_a_decode_step_takes_the_launches_it_should(choice):
    """A cost property no numeric test sees: what each decode layer launches (a fusion that
    silently stops applying shows up here, not in the results)."""
    if not cuda.cuda_built():
        pytest.skip("no CUDA backend in this build")
    (model, args) = {n: (m, a) for n, m, a in _models()}["decode"]
    program = _core.load_pt2(data=save_bytes(export_program(model, args)), load_weights=False)
    assert cuda.generated_source(program, choice)["steps"] == DECODE_STEPS[choice]


def test_a_decode_step_with_a_dynamic_cache_length_takes_the_same_launches():
    """With the cache length symbolic (``torch.compile(dynamic=True)``), the query's length
    is ``min(pos + 1, n) - min(pos, n)`` (the rotary table sliced at the position), not 1:
    the step must still take split attention, not the prefill kernel's one block per head
    looping over every key (16× slower at 1024 keys on an H200)."""
    (model, args) = {n: (m, a) for n, m, a in _models()}["decode"]
    gen = cuda.generated_source(_dynamic_program("decode", model, args))
    assert gen["steps"] == DECODE_STEPS[None]
    # The split kernel, writing and combining its partial results.
    assert gen["source"].count("float* __restrict__ part, i64* __restrict__ cnt)") >= 1
    assert "ember_arrive(cnt + row)" in gen["source"]


def test_a_decode_loop_through_dynamo_is_one_program_with_the_decode_launches():
    """``torch.compile(dynamic=True)`` of a decode step (what `bench.gpu_llama` runs): the
    key and value caches share Dynamo's length symbol, so one program serves every length
    (none specialized per length), and its query is one row (split attention)."""
    from ember.backend import live_programs

    torch.manual_seed(0)
    step = LlamaDecodeStep(Llama(SMALL)).eval()
    options = {"backend": "cuda-emu", "search_iterations": 0, "fallback": "error"}
    compiled = torch.compile(step, backend="ember", dynamic=True, options=options)
    before = live_programs()
    with torch.no_grad():
        # Lengths no other dim of the model has (Dynamo would give them one symbol).
        for length in (5, 11, 13):
            args = [torch.randint(0, SMALL.vocab, (1, 1)), *llama_cache(SMALL, 1, length)]
            torch.testing.assert_close(compiled(*args), step(*args), rtol=1e-4, atol=1e-4)
    new = [p for p in live_programs() if all(p is not q for q in before)]
    assert len(new) == 1, f"{len(new)} programs for three cache lengths"
    assert cuda.generated_source(new[0]._program)["steps"] == DECODE_STEPS[None]


@pytest.mark.nvrtc
def test_nvrtc_reports_compile_errors_clearly():
    if cuda.nvrtc_version() is None:
        pytest.skip("libnvrtc not found")
    with pytest.raises(_core.CompileError, match="NVRTC could not compile"):
        cuda.nvrtc_compile('extern "C" __global__ void k() { undeclared_thing(); }', "sm_90")


@pytest.mark.parametrize("name", ["mlp", "llama", "decode", "resnet", "mobilenet"])
def test_models_match_eager_on_the_emulated_cuda_kernels(name):
    (model, args) = {n: (m, a) for n, m, a in _models()}[name]
    check(model, args, "cuda-emu", rtol=1e-4, atol=1e-4)


ON_THE_GPU = pytest.param(
    "cuda",
    marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not ember.cuda_available(), reason="needs an NVIDIA GPU"),
    ],
)


@pytest.mark.parametrize("backend", ["cuda-emu", ON_THE_GPU])
@pytest.mark.parametrize("choice", PRODUCT_CHOICES)
@pytest.mark.parametrize("name", ["mlp", "llama", "decode"])
def test_models_match_eager_with_every_product_kernel(name, choice, backend, monkeypatch):
    """Each product kernel the optimizer may choose instead of cuBLASLt, taken for every
    product of a whole model (with the epilogues and packed loads it brings); the emulator
    launches as the GPU does."""
    monkeypatch.setenv("EMBER_CUDA_PRODUCTS", choice)
    monkeypatch.setenv("EMBER_EMULATE_GPU_LAUNCHES", "1")
    (model, args) = {n: (m, a) for n, m, a in _models()}[name]
    check(model, args, backend, rtol=1e-4, atol=1e-4)


def test_an_unknown_forced_product_kernel_is_refused(monkeypatch):
    monkeypatch.setenv("EMBER_CUDA_PRODUCTS", "cuda.nope")
    (model, args) = {n: (m, a) for n, m, a in _models()}["mlp"]
    compiled = torch.compile(model, backend="ember", options={"backend": "cuda-emu"})
    with pytest.raises(Exception, match="no kernel choice 'cuda.nope'"):
        compiled(*args)


def test_out_of_range_index_on_the_generated_kernels_raises_naming_the_node():
    emb = torch.nn.Embedding(10, 4).eval()
    compiled = torch.compile(emb, backend="ember", options={"backend": "cuda-emu"})
    ok = torch.tensor([[1, 9, 0]])
    with torch.no_grad():
        torch.testing.assert_close(compiled(ok), emb(ok))
        with pytest.raises(ember.EmberRuntimeError, match="index out of range in"):
            compiled(torch.tensor([[1, 10, 2]]))


def test_kernels_at_the_gpus_launch_sizes(monkeypatch):
    """The emulator normally launches few, narrow blocks; here it launches as the GPU does
    (256 threads a block, a block per row), for the cooperative kernels."""
    monkeypatch.setenv("EMBER_EMULATE_GPU_LAUNCHES", "1")

    def fn(x, q, k, v):
        a = torch.softmax(x, dim=-1) + torch.nn.functional.layer_norm(x, x.shape[-1:])
        b = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return a, x.sum(dim=0), x.argmax(dim=1), b

    args = [rand(3, 300), rand(1, 2, 5, 8), rand(1, 2, 5, 8), rand(1, 2, 5, 8)]
    check(fn, args, "cuda-emu", rtol=1e-4, atol=1e-4)


class _KeyValueCaches(torch.nn.Module):
    """A layer's static key and value caches updated at one position (`index_copy_`, as
    transformers' `StaticCache`), then read."""

    def forward(self, k, v, pos, keys, values):
        keys.index_copy_(2, pos, k * 2)
        values.index_copy_(2, pos, v)
        return keys.sum(2) + values.sum(2)


@pytest.mark.parametrize("backend", ["cuda-emu", ON_THE_GPU])
def test_a_layers_key_and_value_cache_updates_share_a_launch(backend):
    """The key and value updates are one launch (after both copies, which an in-place call
    skips), written in place into the caller's caches, and not at all when an index is
    out of range."""
    device = "cuda" if backend == "cuda" else "cpu"
    options = {"device": "cuda"} if backend == "cuda" else {"backend": backend}

    def caches() -> list[torch.Tensor]:
        return [torch.zeros(1, 2, 6, 4, device=device) for _ in range(2)]

    def step(position: int) -> list[torch.Tensor]:
        k, v = (rand(1, 2, 1, 4).to(device) for _ in range(2))
        return [k, v, torch.tensor([position], device=device)]

    model = _KeyValueCaches()
    ours, theirs = caches(), caches()
    compiled = ember.compile(model, *step(0), *[c.clone() for c in ours], **options)
    assert compiled._in_place == {0: 3, 1: 4}, compiled._in_place
    # The index check, the two copies, the shared updates, two sums and their add.
    gen = cuda.generated_source(compiled._program)
    assert gen["steps"] == 7 and gen["source"].count("if (meta[0] != 0) return;") == 1
    with torch.no_grad():
        for position in (0, 5, 3):
            args = step(position)
            torch.testing.assert_close(compiled(*args, *ours), model(*args, *theirs))
            for a, b in zip(ours, theirs, strict=True):
                torch.testing.assert_close(a, b)
        before = [c.clone() for c in ours]
        with pytest.raises(ember.EmberRuntimeError, match="out of range"):
            compiled(*step(6), *ours)
        for a, b in zip(ours, before, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
