"""Greedy generation with a ``transformers`` static KV cache (``StaticCache``, the cache
``torch.compile`` users are told to take) against the default dynamic cache: ms per token
of eager and of Ember compiling the model's ``forward`` (and, with ``--runners``, of
TorchInductor: ``inductor-ro`` is ``mode="reduce-overhead"``, the CUDA-graph mode
transformers recommends with a static cache). A static cache is written in place
(``index_copy_``) and read whole every step, so its length, not the tokens so far, sets
the memory traffic; Ember writes the new rows straight into the caller's cache.

    python3 -m bench.static_cache [--lengths 1024] [--tokens 32]   # CPU, 2 threads
    python3 -m bench.static_cache --device cuda --size 1b --dtype bfloat16 \\
        --runners eager,ember,inductor-ro                            # a GPU

Times are the second of two identical generations (the first compiles), per token, the
device synchronized around it; every runner's tokens are checked against eager's.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import transformers

RUNNERS = ("eager", "ember", "inductor", "inductor-ro")


def _config(size: str) -> transformers.LlamaConfig:
    if size == "1b":
        # Llama-3.2-1B's layer shape (grouped-query attention, 4 query heads per key/value
        # head), 4 of its 16 layers: a decode step's shape without minutes of compiling.
        return transformers.LlamaConfig(
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=4,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=4096,
        )
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


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _generate(
    model: torch.nn.Module, tokens: int, cache: Callable[[], object], device: str
) -> tuple[torch.Tensor, float]:
    """The second of two identical generations (the first compiles): its tokens, and ms per
    token."""
    prompt = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(device)
    settings = {
        "max_new_tokens": tokens,
        "min_new_tokens": tokens,
        "do_sample": False,
        "pad_token_id": 0,
    }
    with torch.no_grad():
        model.generate(prompt, past_key_values=cache(), **settings)
        _sync(device)
        start = time.perf_counter()
        out = model.generate(prompt, past_key_values=cache(), **settings)
        _sync(device)
    return out, (time.perf_counter() - start) / tokens * 1e3


def _runner(name: str, state: dict, cfg, device: str, dtype: torch.dtype) -> torch.nn.Module:
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.load_state_dict(state)
    model = model.to(device=device, dtype=dtype)
    if name == "ember":
        options = {"search_iterations": 0}
        if device == "cuda":
            options["device"] = "cuda"
        model.forward = torch.compile(model.forward, backend="ember", options=options)
    elif name == "inductor":
        model.forward = torch.compile(model.forward)
    elif name == "inductor-ro":
        model.forward = torch.compile(model.forward, mode="reduce-overhead")
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lengths", default="1024", help="static cache lengths")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--size", default="small", choices=("small", "1b"))
    p.add_argument("--runners", default="eager,ember", help=f"any of {','.join(RUNNERS)}")
    p.add_argument("--no-dynamic", action="store_true", help="static caches only")
    args = p.parse_args(argv)
    runners = [r for r in args.runners.split(",") if r]
    if unknown := set(runners) - set(RUNNERS):
        p.error(f"unknown runners {sorted(unknown)}")
    if args.device == "cpu":
        torch.set_num_threads(2)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    cfg = _config(args.size)
    state = transformers.LlamaForCausalLM(cfg).state_dict()
    caches: list[tuple[str, Callable[[], object]]] = []
    if not args.no_dynamic:
        caches.append(("dynamic", lambda: None))
    for n in (int(v) for v in args.lengths.split(",")):
        caches.append(
            (f"static {n}", lambda n=n: transformers.StaticCache(config=cfg, max_cache_len=n))
        )
    if args.device == "cuda":
        print("device", torch.cuda.get_device_name(), args.dtype, args.size)
    others = [r for r in runners if r != "eager"]
    print(
        "| cache | eager ms/token | "
        + " | ".join(f"{r} ms/token | {r} / eager" for r in others)
        + " |\n|---|---:|"
        + "---:|---:|" * len(others)
    )
    for label, cache in caches:
        # Compiled afresh for each cache: Dynamo's guards (and its recompile limit) do not
        # carry one cache's programs into the next.
        torch._dynamo.reset()
        models = {r: _runner(r, state, cfg, args.device, dtype) for r in ["eager", *others]}
        want, e = _generate(models["eager"], args.tokens, cache, args.device)
        cells = []
        for r in others:
            try:
                got, t = _generate(models[r], args.tokens, cache, args.device)
                same = "" if torch.equal(got, want) else " (tokens differ)"
                cells.append(f"{t:.2f}{same} | {t / e:.2f}×")
            except Exception as err:  # a runner that fails still leaves the others' rows
                cells.append(f"error: {type(err).__name__}: {str(err)[:80]} | –")
        print(f"| {label} | {e:.2f} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
