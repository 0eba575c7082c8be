"""Greedy generation with a ``transformers`` static KV cache (``StaticCache``, the cache
``torch.compile`` users are told to take) against the default dynamic cache: ms per token
of eager and of Ember compiling the model's ``forward``, on the CPU, 2 threads. A static
cache is written in place (``index_copy_``) and read whole every step, so its length, not
the tokens so far, sets the memory traffic.

    python3 -m bench.static_cache [--lengths 1024] [--tokens 32]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import transformers


def _config() -> transformers.LlamaConfig:
    # A small llama with grouped-query attention (two query heads per key/value head).
    return transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )


def _ms_per_token(model: torch.nn.Module, tokens: int, cache: Callable[[], object]) -> float:
    """The second of two identical generations (the first compiles), per token."""
    prompt = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(0))
    settings = {
        "max_new_tokens": tokens,
        "min_new_tokens": tokens,
        "do_sample": False,
        "pad_token_id": 0,
    }
    with torch.no_grad():
        model.generate(prompt, past_key_values=cache(), **settings)
        start = time.perf_counter()
        model.generate(prompt, past_key_values=cache(), **settings)
    return (time.perf_counter() - start) / tokens * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lengths", default="1024", help="static cache lengths")
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    torch.manual_seed(0)
    cfg = _config()
    eager = transformers.LlamaForCausalLM(cfg).eval()
    ember_model = transformers.LlamaForCausalLM(cfg).eval()
    ember_model.load_state_dict(eager.state_dict())
    ember_model.forward = torch.compile(
        ember_model.forward, backend="ember", options={"search_iterations": 0}
    )
    caches: list[tuple[str, Callable[[], object]]] = [("dynamic", lambda: None)]
    for n in (int(v) for v in args.lengths.split(",")):
        caches.append(
            (f"static {n}", lambda n=n: transformers.StaticCache(config=cfg, max_cache_len=n))
        )
    print("| cache | eager ms/token | Ember ms/token | Ember / eager |\n|---|---:|---:|---:|")
    for label, cache in caches:
        e = _ms_per_token(eager, args.tokens, cache)
        g = _ms_per_token(ember_model, args.tokens, cache)
        print(f"| {label} | {e:.2f} | {g:.2f} | {g / e:.2f}× |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
