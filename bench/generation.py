"""The generation-loop case: greedy ``generate()`` of a ``transformers`` model, each backend
compiling only the model's ``forward`` (a generation loop is Python around many calls of it,
not one graph)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn


class GenerationLoop(nn.Module):
    """``forward(input_ids)`` generates exactly ``tokens`` new tokens greedily (a KV cache,
    one prefill, then one decode step per token) and returns all token ids."""

    def __init__(self, model: nn.Module, tokens: int) -> None:
        super().__init__()
        self.model = model
        self.tokens = tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=self.tokens,
            min_new_tokens=self.tokens,
            do_sample=False,
            pad_token_id=0,
        )

    def with_forward(self, compile_fn: Callable[[Callable[..., object]], object]) -> GenerationLoop:
        """The same loop (same weights) whose model's ``forward`` is ``compile_fn(forward)``;
        this loop keeps the eager one, so backends can take turns."""
        # Every backend compiles the same `forward` code object, each for a few shapes;
        # Dynamo's default limit of compiled variants per code object would make the later
        # backends silently run eager.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 512
        )
        model = copy.copy(self.model)  # shallow: shares modules and weights
        model.forward = compile_fn(self.model.forward)
        return GenerationLoop(model, self.tokens)


def llama_generation(tokens: int = 32, prompt: int = 16) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """``transformers``' LlamaForCausalLM at `ember.hf_models`' size, a prompt of ``prompt``
    tokens."""
    from ember import hf_models

    model = hf_models.build("llama")
    # Random weights give flat logits; larger ones make greedy choices far apart, so all
    # backends pick the same tokens despite rounding differences.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    ids = torch.randint(0, hf_models.VOCAB, (1, prompt))
    return GenerationLoop(model, tokens), (ids,)
