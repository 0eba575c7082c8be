"""Whole models through torch.compile(backend="ember") against eager."""

import pytest
import torch
from conftest import check, rand
from ember.backend import programs_compiled
from ember.models import MLP, Llama, LlamaConfig, LlamaDecodeStep, NormChain, llama_cache
from ember.models import Block as LlamaBlock

TOL = {"rtol": 1e-4, "atol": 1e-4}
SMALL = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, max_seq=32)
# Heads of 16 dims: f16/bf16 attention on CUDA's tensor cores (`cuda.mma_attention`).
WIDE_HEADS = LlamaConfig(vocab=64, dim=64, layers=2, heads=4, kv_heads=2, hidden=96, max_seq=32)


def test_mlp(backend):
    check(MLP((16, 32, 32, 8)), [rand(4, 16)], backend, **TOL, new_inputs=[rand(4, 16)])


def test_llama_decoder_block(backend):
    block = LlamaBlock(SMALL)
    cos, sin = torch.rand(7, 8), torch.rand(7, 8)
    check(lambda x: block(x, cos, sin)[0], [rand(2, 7, 32)], backend, **TOL)


def test_llama_prefill(backend):
    model = Llama(SMALL)
    tokens = torch.randint(0, SMALL.vocab, (2, 9))
    check(model, [tokens], backend, **TOL, new_inputs=[torch.randint(0, SMALL.vocab, (2, 9))])


def test_llama_prefill_with_dynamic_shapes_is_one_program():
    """The benchmarks compile with dynamic=True: the prompt length is symbolic, and nothing
    in the model may break Dynamo's graph (a break per layer made 4 programs a layer)."""
    model = Llama(SMALL).eval()
    compiled = torch.compile(model, backend="ember", dynamic=True, options={"fallback": "error"})
    before = programs_compiled()
    with torch.no_grad():
        for length in (9, 13):
            tokens = torch.randint(0, SMALL.vocab, (1, length))
            torch.testing.assert_close(compiled(tokens), model(tokens), **TOL)
    assert programs_compiled() - before == 1


def test_llama_decode_step_with_kv_cache(backend):
    step = LlamaDecodeStep(Llama(SMALL))
    token = torch.randint(0, SMALL.vocab, (1, 1))
    check(step, [token, *llama_cache(SMALL, 1, 5)], backend, **TOL)


# Head dim 40: the attention's 32- and 8-lane blocks; 19 cached keys: its 8-key blocks
# and a tail.
HEAD_DIM_40 = LlamaConfig(vocab=64, dim=160, layers=2, heads=4, kv_heads=2, hidden=96, max_seq=32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama_decode_in_half_precision_is_as_close_to_f32_as_eager(backend, dtype):
    """One-token decode of a 16-bit model (one-row products, attention over a 16-bit
    cache): Ember's error against the f32 step is no worse than eager's."""
    config = HEAD_DIM_40
    reference = LlamaDecodeStep(Llama(config)).eval()
    model = LlamaDecodeStep(Llama(config)).eval()
    model.load_state_dict(reference.state_dict())
    model = model.to(dtype)
    inputs = [torch.randint(0, config.vocab, (1, 1)), *llama_cache(config, 1, 19)]
    options = {"backend": backend, "fallback": "error"}
    if backend == "cuda":
        reference, model = reference.cuda(), model.cuda()
        inputs = [x.cuda() for x in inputs]
        options = {"device": "cuda", "fallback": "error"}
    half_inputs = [x if x.dtype == torch.int64 else x.to(dtype) for x in inputs]
    compiled = torch.compile(model, backend="ember", options=options)

    def error(outputs: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> float:
        return max((o.float() - w).abs().max().item() for o, w in zip(outputs, want, strict=True))

    with torch.no_grad():
        want = reference(*inputs)
        eager_err = error(model(*half_inputs), want)
        got = compiled(*half_inputs)
    assert all(o.dtype == dtype for o in got)
    ember_err = error(got, want)
    assert ember_err <= 1.5 * eager_err + 1e-3, (ember_err, eager_err)


def test_transformer_encoder(backend):
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    check(encoder, [rand(2, 6, 32)], backend, **TOL)


def test_norm_chain(backend):
    check(NormChain(24), [rand(3, 24)], backend, **TOL)


@pytest.mark.parametrize("config", [SMALL, WIDE_HEADS], ids=["heads8", "heads16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama_in_half_precision_is_as_close_to_f32_as_eager(backend, dtype, config):
    """A 16-bit model: Ember's error against the f32 model is no worse than eager's."""
    reference = Llama(config).eval()
    model = Llama(config).eval()
    model.load_state_dict(reference.state_dict())
    model = model.to(dtype)
    tokens = torch.randint(0, config.vocab, (2, 9))
    options = {"backend": backend, "fallback": "error"}
    if backend == "cuda":
        reference, model, tokens = reference.cuda(), model.cuda(), tokens.cuda()
        options = {"device": "cuda", "fallback": "error"}
    compiled = torch.compile(model, backend="ember", options=options)
    with torch.no_grad():
        want = reference(tokens)
        eager_err = (model(tokens).float() - want).abs().max().item()
        got = compiled(tokens)
    assert got.dtype == dtype
    ember_err = (got.float() - want).abs().max().item()
    assert ember_err <= 1.5 * eager_err + 1e-3, (ember_err, eager_err)
