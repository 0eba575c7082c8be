"""Hugging Face ``transformers`` models through torch.compile(backend="ember") against eager:
built from small random configs (nothing is downloaded), forward outputs compared on random
inputs, and greedy generation compared token for token with a bound on compiled programs."""

import contextlib
from collections.abc import Callable

import pytest
import torch
from conftest import BACKENDS, _cuda_reference
from ember.backend import live_programs, programs_compiled

transformers = pytest.importorskip("transformers")

# fp32 through a few layers of matmuls, norms and softmax: products of ~100 terms reordered.
TOL = {"rtol": 1e-4, "atol": 1e-4}
VOCAB = 100
# Larger than the default 0.02, so that next-token logits differ by far more than rounding
# error and greedy decoding is a fair comparison.
INIT = 0.2


def _decoder(config_cls, model_cls, layers: int = 2, **extra) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        config = config_cls(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            initializer_range=INIT,
            **extra,
        )
        return model_cls(config)

    return build


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, initializer_range=INIT
    )
    return transformers.GPT2LMHeadModel(config)


def _bert() -> torch.nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        initializer_range=INIT,
    )
    return transformers.BertModel(config)


def _vit() -> torch.nn.Module:
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
        initializer_range=INIT,
    )
    return transformers.ViTModel(config)


def _t5_encoder() -> torch.nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4
    )
    return transformers.T5EncoderModel(config)


# MoE experts as batched matmuls over the routed experts ("batched_mm"); the default
# ("grouped_mm": tokens sorted by expert, a grouped product) is
# test_moe_with_the_default_grouped_experts.
_MOE = {"num_experts_per_tok": 2, "experts_implementation": "batched_mm"}

DECODERS = {
    "llama": _decoder(transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": _decoder(transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": _decoder(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, head_dim=8),
    "gemma": _decoder(transformers.GemmaConfig, transformers.GemmaForCausalLM, head_dim=8),
    "mistral": _decoder(transformers.MistralConfig, transformers.MistralForCausalLM),
    "gpt2": _gpt2,
    "qwen2_moe": _decoder(
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        num_experts=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        **_MOE,
    ),
    "mixtral": _decoder(
        transformers.MixtralConfig, transformers.MixtralForCausalLM, num_local_experts=4, **_MOE
    ),
}
ENCODERS = {"bert": _bert, "vit": _vit, "t5_encoder": _t5_encoder}


def _inputs(name: str) -> dict[str, torch.Tensor]:
    if name == "vit":
        return {"pixel_values": torch.randn(2, 3, 32, 32)}
    ids = torch.randint(0, VOCAB, (2, 7))
    if name == "bert":
        # Padding in the second sequence: the attention mask must reach the softmax.
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[1, 5:] = 0
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    return {"input_ids": ids}


def _main_output(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


# The backends a model test runs on (the reference interpreter is too slow for models).
MODEL_BACKENDS = [b for b in BACKENDS if b != "reference"]


def _device_options(backend: str) -> tuple[str, dict]:
    """Where a model test's tensors live, and the Ember options that run it there."""
    if backend == "cuda":
        return "cuda", {"device": "cuda"}
    return "cpu", {"backend": backend}


def _reference(device: str) -> contextlib.AbstractContextManager:
    """Around eager's run: on the GPU, cuDNN convolutions in full f32 (as Ember's)."""
    return _cuda_reference() if device == "cuda" else contextlib.nullcontext()


@pytest.mark.parametrize("backend", MODEL_BACKENDS)
@pytest.mark.parametrize("name", [*DECODERS, *ENCODERS])
def test_forward_matches_eager(name, backend):
    device, options = _device_options(backend)
    model = {**DECODERS, **ENCODERS}[name]().eval().to(device)
    compiled = torch.compile(model, backend="ember", options={"fallback": "error", **options})
    before = programs_compiled()
    tol = TOL if device == "cpu" else {"rtol": 1e-3, "atol": 1e-3}
    with torch.no_grad():
        for _ in range(2):
            inputs = {k: v.to(device) for k, v in _inputs(name).items()}
            with _reference(device):
                want = _main_output(model(**inputs))
            got = _main_output(compiled(**inputs))
            torch.testing.assert_close(got, want, **tol)
    assert programs_compiled() > before, "Ember did not compile this model"


# Each generation traces and compiles three programs (over 10 s); llama stays in the default
# run as the representative.
GENERATE = [n if n == "llama" else pytest.param(n, marks=pytest.mark.slow) for n in DECODERS]


def check_greedy_generate(
    model: torch.nn.Module, prompt: torch.Tensor, options: dict | None = None, **extra
) -> None:
    """Greedy ``generate()`` of 32 tokens with ``torch.compile(model.forward, backend="ember")``
    is token-identical to eager and compiles at most four programs (prefill, the first decode
    step, one symbolic program for every later step; static caches: prefill and decode)."""
    settings = {"max_new_tokens": 32, "min_new_tokens": 32, "do_sample": False, "pad_token_id": 0}
    settings.update(extra)
    with torch.no_grad():
        want = model.generate(prompt, **settings)
    before = programs_compiled()
    model.forward = torch.compile(
        model.forward,
        backend="ember",
        options={"fallback": "error", "search_iterations": 0, **(options or {})},
    )
    with torch.no_grad():
        got = model.generate(prompt, **settings)
    assert got.shape == (1, prompt.shape[1] + settings["max_new_tokens"])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    compiled = programs_compiled() - before
    assert 1 <= compiled <= 4, f"{compiled} programs for {settings['max_new_tokens']} tokens"


@pytest.mark.parametrize("name", GENERATE)
def test_greedy_generate_matches_eager_with_few_programs(name):
    check_greedy_generate(DECODERS[name]().eval(), torch.randint(0, VOCAB, (1, 5)))


# 12 layers: the later layers' cache positions are computed after the first layer's
# update (launches of one shape are grouped eight at a time); CUDA's index check before the
# first update recomputes them, so every layer's caches are still written in place.
@pytest.mark.parametrize("layers, tokens", [(2, 16), (12, 3)])
@pytest.mark.parametrize("backend", MODEL_BACKENDS)
def test_greedy_generate_with_static_cache(backend, layers, tokens):
    """A StaticCache writes each step's keys into preallocated tensors in place (index_copy_
    on graph inputs); Ember writes them straight into the caller's cache (every layer's keys
    and values, in the decode program), with no copy back."""
    device, options = _device_options(backend)
    llama = _decoder(transformers.LlamaConfig, transformers.LlamaForCausalLM, layers=layers)
    model = llama().eval().to(device)
    prompt = torch.randint(0, VOCAB, (1, 5), device=device)
    earlier = {id(p) for p in live_programs()}
    check_greedy_generate(
        model,
        prompt,
        options,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        cache_implementation="static",
    )
    in_place = [len(p._in_place) for p in live_programs() if id(p) not in earlier]
    assert 2 * layers in in_place, in_place


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_moe_with_the_default_grouped_experts(name):
    """transformers' default MoE experts ("grouped_mm") sort the routed tokens by expert
    (aten.sort), count tokens per expert (aten.histc) and run a grouped product
    (transformers' grouped_mm_fallback op on CPU): all compiled, nothing left to eager."""
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts_per_tok": 2,
        "initializer_range": INIT,
    }
    if name == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, **common
        )
        model_class = transformers.Qwen2MoeForCausalLM
    else:
        config = transformers.MixtralConfig(num_local_experts=4, **common)
        model_class = transformers.MixtralForCausalLM
    model = model_class(config).eval()
    assert model.config._experts_implementation == "grouped_mm"
    compiled = torch.compile(model, backend="ember", options={"fallback": "error"})
    before = programs_compiled()
    with torch.no_grad():
        for _ in range(2):
            ids = torch.randint(0, VOCAB, (2, 7))
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits, **TOL)
    assert programs_compiled() > before
