"""``python3 -m bench.reference_speed``: how long one run of the reference interpreter takes
on a llama decode step at the GPU benchmark's shapes (``bench.gpu_llama``, bf16), with fewer
layers. The measured search verifies every candidate against this interpreter on the host,
so its time bounds what a search of a large model costs. Prints the median of the timed
runs (weights are converted once, at compile time; the first run is not timed).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import ember
import torch
from ember.models import Llama, LlamaDecodeStep, llama_cache

from bench.gpu_llama import BILLION


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--length", type=int, default=128, help="the cache length")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    cfg = dataclasses.replace(BILLION, layers=args.layers)
    torch.manual_seed(0)
    model = Llama(cfg).to(torch.bfloat16).eval()
    for q in model.parameters():
        q.requires_grad_(False)
    step = LlamaDecodeStep(model).eval()
    token = torch.randint(0, cfg.vocab, (1, 1))
    cache = [t.bfloat16() for t in llama_cache(cfg, 1, args.length)]
    compiled = ember.compile(
        step, token, *cache, backend="reference", quiet=True, search_iterations=0, cache=False
    )
    with torch.no_grad():
        compiled(token, *cache)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            compiled(token, *cache)
            times.append(time.perf_counter() - start)
    print(
        f"reference interpreter, llama decode step at the 1B shapes, {args.layers} layers, "
        f"cache {args.length}: {statistics.median(times):.2f} s a run "
        f"(median of {args.repeats})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
