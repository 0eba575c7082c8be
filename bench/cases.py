"""The benchmarked models: each case builds a model in eval mode and its example inputs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from ember.models import (
    MLP,
    Llama,
    LlamaConfig,
    LlamaDecodeStep,
    NormChain,
    ResNet,
    llama_cache,
)
from torch import nn

from bench.generation import llama_generation

SEED = 0
GENERATED_TOKENS = 32


@dataclasses.dataclass(frozen=True)
class Case:
    """A benchmark case: a name for ``--models``, a description for the report and a builder."""

    name: str
    title: str
    description: str
    build: Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]
    tokens: int = 0  # new tokens per call, for generation loops (the report adds tokens/s)

    def make(self) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        """The model (eval mode, no gradients) and its inputs, built from a fixed seed."""
        torch.manual_seed(SEED)
        model, inputs = self.build()
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        return model, inputs


def _mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = MLP()
    return model, (torch.randn(32, model.layers[0].in_features),)


def _prefill() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    cfg = LlamaConfig()
    return Llama(cfg), (torch.randint(0, cfg.vocab, (1, 64)),)


def _decode() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    cfg = LlamaConfig()
    model = LlamaDecodeStep(Llama(cfg))
    token = torch.randint(0, cfg.vocab, (1, 1))
    return model, (token, *llama_cache(cfg, 1, 128))


def _chain() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return NormChain(512), (torch.randn(64, 512),)


def _cnn() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return ResNet(), (torch.randn(4, 3, 64, 64),)


def _moe() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from ember import hf_models

    model = hf_models.MainOutput(hf_models.build("mixtral"))
    ids = torch.randint(0, hf_models.VOCAB, (1, 64))
    return model, (ids, torch.ones_like(ids))


def _generate() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return llama_generation(tokens=GENERATED_TOKENS, prompt=16)


_cfg = LlamaConfig()
_llama = (
    f"{_cfg.layers} layers, dim {_cfg.dim}, {_cfg.heads} heads / {_cfg.kv_heads} KV heads, "
    f"SwiGLU hidden {_cfg.hidden}, vocab {_cfg.vocab}"
)

CASES: dict[str, Case] = {
    case.name: case
    for case in (
        Case("mlp", "MLP", "`ember.models.MLP()` (256→1024→1024→256, GELU), input [32, 256]", _mlp),
        Case(
            "prefill",
            "Llama prefill",
            f"`ember.models.Llama()` ({_llama}), one prompt of 64 tokens → logits [1, 64, 512]",
            _prefill,
        ),
        Case(
            "decode",
            "Llama decode step",
            f"`LlamaDecodeStep(Llama())` ({_llama}): one token with a KV cache of 128 positions "
            "(`llama_cache(cfg, 1, 128)`) → logits and the grown caches",
            _decode,
        ),
        Case(
            "chain",
            "Elementwise/norm chain",
            "`ember.models.NormChain(512)` (layer norm, scale-shift, GELU, residual, softmax, "
            "sigmoid·tanh), input [64, 512]",
            _chain,
        ),
        Case(
            "cnn",
            "ResNet-style CNN",
            "`ember.models.ResNet()` (3×3 stem, max pool, 6 basic blocks of widths 32/64/128 with "
            "eval batch norm, global average pool, linear head), input [4, 3, 64, 64]",
            _cnn,
        ),
        Case(
            "moe",
            "transformers Mixtral (mixture of experts) prefill",
            "`transformers.MixtralForCausalLM` (`ember.hf_models`: 4 layers, hidden 256, "
            "8 experts of width 172, 2 per token, default grouped experts: sort, histc, "
            "grouped matmul; random weights), one prompt of 64 tokens → logits [1, 64, 1024]",
            _moe,
        ),
        Case(
            "generate",
            "transformers Llama generation loop",
            "`transformers.LlamaForCausalLM` (`ember.hf_models`: 4 layers, hidden 256, 8 heads / "
            "4 KV heads, vocab 1024, random weights): greedy `generate()` of "
            f"{GENERATED_TOKENS} new tokens after a 16-token prompt, with a `DynamicCache`. "
            "Each backend compiles the model's `forward` (`torch.compile(model.forward, "
            'backend="ember")`, Inductor\'s default); ORT and Ember (ONNX file) do not run '
            "generation loops. Output: the token ids.",
            _generate,
            tokens=GENERATED_TOKENS,
        ),
    )
}
