"""Built-in models for the demo, tests and benchmarks: small, random weights, no downloads."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 512
    dim: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    hidden: int = 688
    max_seq: int = 256
    rope_theta: float = 10000.0
    eps: float = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.dim // cfg.heads
        self.q = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if cache is not None:
            k = torch.cat((cache[0], k), dim=2)
            v = torch.cat((cache[1], v), dim=2)
        # Prefill is causal; a one-token decode step attends to the whole cache.
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=cache is None and t > 1, enable_gqa=True
        )
        out = out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return self.o(out), (k, v)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.eps)
        self.gate = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x, cos, sin, cache=None):
        a, new_cache = self.attn(self.attn_norm(x), cos, sin, cache)
        x = x + a
        h = self.mlp_norm(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return x, new_cache


class Llama(nn.Module):
    """A small llama-style decoder: RMSNorm, RoPE, grouped-query causal attention, SwiGLU."""

    def __init__(self, cfg: LlamaConfig = LlamaConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        head_dim = cfg.dim // cfg.heads
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(cfg.max_seq).float(), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for every position of a prompt (prefill)."""
        t = tokens.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embed(tokens)
        for block in self.blocks:
            x, _ = block(x, cos, sin)
        return self.lm_head(self.norm(x))


class LlamaDecodeStep(nn.Module):
    """One-token decode with a KV cache: (token, position, caches...) → (logits, caches...)."""

    def __init__(self, model: Llama) -> None:
        super().__init__()
        self.model = model

    def forward(self, token: torch.Tensor, *cache: torch.Tensor):
        m = self.model
        pos = cache[0].shape[2]
        cos, sin = m.cos[pos : pos + 1], m.sin[pos : pos + 1]
        x = m.embed(token)
        new_cache = []
        for i, block in enumerate(m.blocks):
            x, (k, v) = block(x, cos, sin, (cache[2 * i], cache[2 * i + 1]))
            new_cache += [k, v]
        return (m.lm_head(m.norm(x)), *new_cache)


def llama_cache(cfg: LlamaConfig, batch: int, length: int) -> list[torch.Tensor]:
    head_dim = cfg.dim // cfg.heads
    return [torch.randn(batch, cfg.kv_heads, length, head_dim) * 0.5 for _ in range(2 * cfg.layers)]


class MLP(nn.Module):
    def __init__(self, sizes: tuple[int, ...] = (256, 1024, 1024, 256)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:], strict=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


class NormChain(nn.Module):
    """An elementwise/normalization chain: layer norm, scale-shift, GELU, residual, softmax."""

    def __init__(self, dim: int = 512) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.scale = nn.Parameter(torch.randn(dim))
        self.shift = nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x) * (1 + self.scale) + self.shift
        h = F.gelu(h) + x
        return torch.softmax(h * 0.5, dim=-1) + torch.sigmoid(h) * torch.tanh(x)
