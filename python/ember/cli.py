"""The ``ember`` command line: ``ember demo``."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def _median_ms(fn, args, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def demo(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ember demo", description=demo.__doc__)
    parser.add_argument("--seq", type=int, default=64, help="prompt length")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's)")
    args = parser.parse_args(argv)

    import ember
    from ember.models import Llama, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig()
    model = Llama(cfg).eval()
    tokens = torch.randint(0, cfg.vocab, (1, args.seq))
    print(
        f"Ember {ember.__version__} demo: llama-style decoder, {cfg.layers} layers, dim {cfg.dim}, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, prompt of "
        f"{args.seq} tokens, {args.threads or torch.get_num_threads()} thread(s)"
    )
    options = {"num_threads": args.threads} if args.threads else {}
    compiled = torch.compile(model, backend="ember", options=options)
    with torch.no_grad():
        start = time.perf_counter()
        out = compiled(tokens)
        compile_s = time.perf_counter() - start
        ref = model(tokens)
        err = (out - ref).abs().max().item()
        # Interleave the two so that machine noise hits both alike.
        eager_ms, ember_ms = [], []
        for _ in range(3):
            eager_ms.append(_median_ms(model, (tokens,), args.repeats))
            ember_ms.append(_median_ms(compiled, (tokens,), args.repeats))
    eager, fast = statistics.median(eager_ms), statistics.median(ember_ms)
    print(f"compile time:          {compile_s:.2f} s")
    print(f"max abs error vs eager: {err:.2e}")
    print(f"eager latency (median): {eager:.2f} ms")
    print(f"ember latency (median): {fast:.2f} ms")
    print(f"speed-up:               {eager / fast:.2f}x")
    if not err <= 1e-4:
        print("ERROR: Ember's output differs from eager PyTorch", file=sys.stderr)
        return 1
    return 0


demo.__doc__ = "Compile a built-in llama-style model and compare it with eager PyTorch."


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": demo}
    if not argv or argv[0] not in commands:
        print("usage: ember {demo} [options]\n  demo  " + (demo.__doc__ or ""), file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])
