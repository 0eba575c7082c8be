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
        # Prefill is causal (also for one token: its own key alone); a decode step attends
        # to the whole cache. (Not `t > 1`: with a dynamic `t` that is a symbolic bool,
        # which sdpa refuses, and Dynamo breaks the graph at every layer's attention.)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None, enable_gqa=True)
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


def _random_batch_norm_stats(model: nn.Module) -> None:
    """Gives every batch norm non-trivial statistics and affine parameters, so that eval-mode
    tests see what a trained network would hold rather than the identity."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)
    )


class BasicBlock(nn.Module):
    """ResNet's two 3×3 conv + batch norm block with an identity or 1×1 projection shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = _conv_bn(cin, cout, 3, stride)
        self.conv2 = _conv_bn(cout, cout, 3)
        self.short = _conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv2(F.relu(self.conv1(x)))
        return F.relu(y + (x if self.short is None else self.short(x)))


class ResNet(nn.Module):
    """A small ResNet-style classifier: 3×3 stem, max pool, stages of basic blocks (each
    after the first halves the resolution), global average pool, linear head."""

    def __init__(self, widths: tuple[int, ...] = (32, 64, 128), classes: int = 10) -> None:
        super().__init__()
        self.stem = _conv_bn(3, widths[0], 3)
        blocks: list[nn.Module] = []
        cin = widths[0]
        for i, w in enumerate(widths):
            blocks += [BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)]
            cin = w
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)
        _random_batch_norm_stats(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.stem(x)), 3, 2, 1)
        x = F.adaptive_avg_pool2d(self.blocks(x), 1)
        return self.head(torch.flatten(x, 1))


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1×1 expansion, depthwise 3×3, 1×1 projection (ReLU6 between),
    with a residual when the shape is kept."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        mid = cin * expand
        self.expand = _conv_bn(cin, mid, 1)
        self.depthwise = _conv_bn(mid, mid, 3, stride, groups=mid)
        self.project = _conv_bn(mid, cout, 1)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu6(self.depthwise(F.relu6(self.expand(x))))
        y = self.project(y)
        return x + y if self.residual else y


class MobileNet(nn.Module):
    """A small MobileNet-style classifier: strided 3×3 stem with hardswish, inverted
    residual blocks (depthwise separable convs), 1×1 conv, global average pool, and a
    hardswish MLP head."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = _conv_bn(3, 16, 3, 2)
        spec = [(16, 16, 1, 1), (16, 24, 2, 4), (24, 24, 1, 4), (24, 40, 2, 4), (40, 40, 1, 4)]
        self.blocks = nn.Sequential(*(InvertedResidual(*s) for s in spec))
        self.last = _conv_bn(40, 96, 1)
        self.head = nn.Sequential(nn.Linear(96, 128), nn.Hardswish(), nn.Linear(128, classes))
        _random_batch_norm_stats(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.hardswish(self.stem(x))
        x = F.hardswish(self.last(self.blocks(x)))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
