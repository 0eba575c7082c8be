"""Hugging Face ``transformers`` models built from small configs with random weights (nothing is
downloaded), for ``ember demo`` and the benchmarks. ``transformers`` is optional: asking for
one of these models without it raises ``ImportError`` saying how to install it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Sized like `ember.models.LlamaConfig`: big enough that kernels, not Python, dominate.
VOCAB = 1024
HIDDEN = 256
LAYERS = 4
HEADS = 8
KV_HEADS = 4
INTERMEDIATE = 688
MAX_POSITIONS = 512

# Mixture of experts: 8 experts of a quarter of the dense width, two per token (Mixtral's
# routing at this size), with transformers' default grouped experts.
EXPERTS = 8
EXPERTS_PER_TOKEN = 2

MODELS = ("llama", "qwen", "gpt2", "bert", "mixtral")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "this model needs the `transformers` package: pip install transformers "
            "(or pip install 'ember[test]')"
        ) from e
    return transformers


def build(name: str) -> nn.Module:
    """The ``transformers`` model ``name`` (one of ``MODELS``), in eval mode, seeded."""
    tf = _transformers()
    torch.manual_seed(0)
    decoder = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": MAX_POSITIONS,
    }
    if name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**decoder))
    elif name == "qwen":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**decoder))
    elif name == "mixtral":
        config = tf.MixtralConfig(
            **{**decoder, "intermediate_size": INTERMEDIATE // 4},
            num_local_experts=EXPERTS,
            num_experts_per_tok=EXPERTS_PER_TOKEN,
        )
        model = tf.MixtralForCausalLM(config)
    elif name == "gpt2":
        config = tf.GPT2Config(
            vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=MAX_POSITIONS
        )
        model = tf.GPT2LMHeadModel(config)
    elif name == "bert":
        config = tf.BertConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            intermediate_size=4 * HIDDEN,
            max_position_embeddings=MAX_POSITIONS,
        )
        model = tf.BertModel(config)
    else:
        raise ValueError(f"unknown transformers model {name!r}; choose from {', '.join(MODELS)}")
    return model.eval()


class MainOutput(nn.Module):
    """A ``transformers`` model as a plain function of tensors returning its main output
    (decoders: logits, without a KV cache; encoders: the last hidden state)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


class DecoderWithPast(nn.Module):
    """One step of a causal LM as ONNX deployments export it (Optimum's
    ``decoder_with_past``): the cache's keys and values are flat inputs (``past`` holds
    layer 0's keys, its values, layer 1's keys, ...) and the logits then the updated keys and
    values, in that order, are the outputs."""

    def __init__(self, model: nn.Module, layers: int) -> None:
        super().__init__()
        self.model, self.layers = model, layers

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        cache = _transformers().DynamicCache()
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        present = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return (out.logits, *present)


def forward_inputs(batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask whose last sequence is padded by a quarter, so the
    mask matters."""
    ids = torch.randint(0, VOCAB, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    if batch > 1:
        mask[-1, seq - seq // 4 :] = 0
    return ids, mask


def describe(name: str, model: nn.Module) -> str:
    params = sum(p.numel() for p in model.parameters()) / 1e6
    return (
        f"transformers {type(model).__name__} ({LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, "
        f"vocab {VOCAB}, random weights), {params:.1f}M parameters"
    )
