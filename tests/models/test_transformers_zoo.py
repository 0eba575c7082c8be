"""A wide sweep of ``transformers`` architectures (small random configs, nothing downloaded):
each compiles whole (``fallback="error"``) and its main output matches eager. A handful of
architectures unlike those in ``test_transformers.py`` run by default; the rest are ``slow``."""

from collections.abc import Callable
from typing import Any

import pytest
import torch
from ember.backend import programs_compiled
from test_transformers import (
    MODEL_BACKENDS,
    _device_options,
    _reference,
    check_greedy_generate,
)

tf = pytest.importorskip("transformers")

VOCAB = 100
TOL = {"rtol": 1e-4, "atol": 1e-4}
LAYERS = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
BLOCK = {**LAYERS, "intermediate_size": 64}
IMAGES = (
    "clip_vision", "siglip_vision", "swin", "convnext", "beit", "resnet", "segformer", "dinov2",
)  # fmt: skip


def _build(config_cls: Any, model_cls: Any, **config: Any) -> Callable[[], torch.nn.Module]:
    return lambda: model_cls(config_cls(**config))


ZOO: dict[str, Callable[[], torch.nn.Module]] = {
    # Decoders.
    "phi3": _build(
        tf.Phi3Config,
        tf.Phi3ForCausalLM,
        vocab_size=VOCAB,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        **BLOCK,
    ),
    "phi": _build(tf.PhiConfig, tf.PhiForCausalLM, vocab_size=VOCAB, **BLOCK),
    "falcon": _build(tf.FalconConfig, tf.FalconForCausalLM, vocab_size=VOCAB, **LAYERS),
    "opt": _build(
        tf.OPTConfig,
        tf.OPTForCausalLM,
        vocab_size=VOCAB,
        ffn_dim=64,
        word_embed_proj_dim=32,
        max_position_embeddings=128,
        **LAYERS,
    ),
    "gpt_neox": _build(tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, vocab_size=VOCAB, **BLOCK),
    "gptj": _build(
        tf.GPTJConfig,
        tf.GPTJForCausalLM,
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        rotary_dim=4,
        n_positions=128,
    ),
    "bloom": _build(
        tf.BloomConfig, tf.BloomForCausalLM, vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4
    ),
    "stablelm": _build(
        tf.StableLmConfig, tf.StableLmForCausalLM, vocab_size=VOCAB, num_key_value_heads=2, **BLOCK
    ),
    "olmo": _build(tf.OlmoConfig, tf.OlmoForCausalLM, vocab_size=VOCAB, pad_token_id=0, **BLOCK),
    "granite": _build(tf.GraniteConfig, tf.GraniteForCausalLM, vocab_size=VOCAB, **BLOCK),
    "starcoder2": _build(
        tf.Starcoder2Config,
        tf.Starcoder2ForCausalLM,
        vocab_size=VOCAB,
        num_key_value_heads=2,
        **BLOCK,
    ),
    "gemma2": _build(
        tf.Gemma2Config,
        tf.Gemma2ForCausalLM,
        vocab_size=VOCAB,
        num_key_value_heads=2,
        head_dim=8,
        **BLOCK,
    ),
    # Encoders.
    "distilbert": _build(
        tf.DistilBertConfig,
        tf.DistilBertModel,
        vocab_size=VOCAB,
        dim=32,
        n_layers=2,
        n_heads=4,
        hidden_dim=64,
    ),
    "roberta": _build(
        tf.RobertaConfig, tf.RobertaModel, vocab_size=VOCAB, max_position_embeddings=130, **BLOCK
    ),
    "albert": _build(tf.AlbertConfig, tf.AlbertModel, vocab_size=VOCAB, embedding_size=16, **BLOCK),
    "electra": _build(
        tf.ElectraConfig, tf.ElectraModel, vocab_size=VOCAB, embedding_size=16, **BLOCK
    ),
    "deberta_v2": _build(tf.DebertaV2Config, tf.DebertaV2Model, vocab_size=VOCAB, **BLOCK),
    "mpnet": _build(tf.MPNetConfig, tf.MPNetModel, vocab_size=VOCAB, **BLOCK),
    "clip_text": _build(
        tf.CLIPTextConfig,
        tf.CLIPTextModel,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        **BLOCK,
    ),
    # Encoder-decoders (both stacks in one forward).
    "bart": _build(
        tf.BartConfig,
        tf.BartModel,
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
    ),
    "t5": _build(
        tf.T5Config,
        tf.T5Model,
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_heads=4,
    ),
    # Vision.
    "clip_vision": _build(
        tf.CLIPVisionConfig, tf.CLIPVisionModel, image_size=32, patch_size=8, **BLOCK
    ),
    "siglip_vision": _build(
        tf.SiglipVisionConfig, tf.SiglipVisionModel, image_size=32, patch_size=8, **BLOCK
    ),
    "dinov2": _build(tf.Dinov2Config, tf.Dinov2Model, image_size=32, patch_size=8, **BLOCK),
    "swin": _build(
        tf.SwinConfig,
        tf.SwinModel,
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=4,
    ),
    # Four stages: the 7×7 depthwise convs of the last ones meet 2×2 and 1×1 maps.
    "convnext": _build(
        tf.ConvNextConfig,
        tf.ConvNextModel,
        hidden_sizes=[8, 16, 16, 16],
        depths=[1, 1, 1, 1],
        num_stages=4,
        image_size=32,
    ),
    # Its relative position table is built by writes into slices of a fresh tensor.
    "beit": _build(
        tf.BeitConfig,
        tf.BeitModel,
        image_size=32,
        patch_size=8,
        use_relative_position_bias=True,
        **BLOCK,
    ),
    "resnet": _build(
        tf.ResNetConfig, tf.ResNetModel, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1]
    ),
    "segformer": _build(
        tf.SegformerConfig,
        tf.SegformerModel,
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[8, 16],
        num_attention_heads=[1, 2],
        patch_sizes=[7, 3],
        strides=[4, 2],
        mlp_ratios=[2, 2],
    ),
    # Audio.
    "whisper_encoder": _build(
        tf.WhisperConfig,
        lambda config: tf.WhisperModel(config).encoder,
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=16,
        max_source_positions=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    ),
    "wav2vec2": _build(
        tf.Wav2Vec2Config,
        tf.Wav2Vec2Model,
        vocab_size=VOCAB,
        conv_dim=(8, 8),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        **BLOCK,
    ),
}

# One per family that test_transformers.py does not already cover.
DEFAULT = {"phi3", "falcon", "deberta_v2", "bart", "swin", "convnext", "beit", "whisper_encoder"}


def _inputs(name: str) -> dict[str, torch.Tensor]:
    if name in IMAGES:
        return {"pixel_values": torch.randn(2, 3, 32, 32)}
    if name == "whisper_encoder":
        return {"input_features": torch.randn(2, 16, 64)}
    if name == "wav2vec2":
        return {"input_values": torch.randn(2, 400)}
    inputs = {"input_ids": torch.randint(1, VOCAB, (2, 7))}
    if name in ("bart", "t5"):
        inputs["decoder_input_ids"] = torch.randint(1, VOCAB, (2, 5))
    return inputs


def _main_output(out: Any) -> torch.Tensor:
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


# On the host, the default set runs on the CPU, the others and the emulated CUDA backend in
# slow runs; a GPU run (`-m cuda`) takes every architecture.
_ZOO_BACKENDS = [
    b if b == "cpu" else pytest.param(b, marks=pytest.mark.slow) if b == "cuda-emu" else b
    for b in MODEL_BACKENDS
]


@pytest.mark.parametrize("backend", _ZOO_BACKENDS)
@pytest.mark.parametrize(
    "name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in ZOO]
)
def test_architecture_compiles_whole_and_matches_eager(name, backend):
    device, options = _device_options(backend)
    torch.manual_seed(0)
    model = ZOO[name]().eval().to(device)
    compiled = torch.compile(
        model,
        backend="ember",
        options={"fallback": "error", "search_iterations": 0, **options},
    )
    before = programs_compiled()
    tol = TOL if device == "cpu" else {"rtol": 1e-3, "atol": 1e-3}
    with torch.no_grad():
        inputs = {k: v.to(device) for k, v in _inputs(name).items()}
        with _reference(device):
            want = _main_output(model(**inputs))
        got = _main_output(compiled(**inputs))
    assert want.abs().max() > 0, "a degenerate configuration: the output is all zeros"
    torch.testing.assert_close(got, want, **tol)
    assert programs_compiled() > before, "Ember did not compile this model"


DECODERS = [
    "phi3", "phi", "falcon", "opt", "gpt_neox", "gptj", "bloom", "stablelm", "olmo", "granite",
    "starcoder2", "gemma2",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", DECODERS)
def test_greedy_generate_matches_eager_with_few_programs(name):
    """32 greedy tokens with a DynamicCache, token-identical to eager, three programs
    (prefill, first step, every later step)."""
    torch.manual_seed(0)
    model = ZOO[name]().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:  # far-apart logits: greedy choices are not decided by rounding
                p.normal_(0, 0.2)
    check_greedy_generate(model, torch.randint(1, VOCAB, (1, 5)))
