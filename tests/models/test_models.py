"""Whole models through torch.compile(backend="ember") against eager."""

import torch
from conftest import check, rand
from ember.models import MLP, Llama, LlamaConfig, LlamaDecodeStep, NormChain, llama_cache
from ember.models import Block as LlamaBlock

TOL = {"rtol": 1e-4, "atol": 1e-4}
SMALL = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, max_seq=32)


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


def test_llama_decode_step_with_kv_cache(backend):
    step = LlamaDecodeStep(Llama(SMALL))
    token = torch.randint(0, SMALL.vocab, (1, 1))
    check(step, [token, *llama_cache(SMALL, 1, 5)], backend, **TOL)


def test_transformer_encoder(backend):
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    check(encoder, [rand(2, 6, 32)], backend, **TOL)


def test_norm_chain(backend):
    check(NormChain(24), [rand(3, 24)], backend, **TOL)
