"""``python3 -m bench.cpu_decode``: a llama at the 1B shapes of ``bench.gpu_llama`` (random
weights, ``--layers`` of them) on the CPU in f32, bf16 or f16 — one-token decode with a KV
cache of each ``--lengths`` and, with ``--prefill N``, one N-token prompt — Ember
(``ember.compile``, ``search_iterations=0`` unless ``--search``) against eager in the same
process: medians of ``--repeats`` calls, alternating the two, each checked against eager.

Decode at these sizes is bound by memory (every weight is read once per token), so also
printed: the weights' bytes over Ember's median, against the machine's read bandwidth
(``torch.sum`` over 1 GiB on the same threads). "compile MB" is how much the process's
resident memory grew over Ember's compile: the copies it keeps (packed weights) and what the
allocator kept of its transients.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections.abc import Callable

import ember
import torch
from ember.models import Llama, LlamaDecodeStep, llama_cache

from bench.gpu_llama import BILLION, TINY

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def _medians(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median ms of each function, calls alternating between them after a warm-up."""
    for f in fns:
        for _ in range(3):
            f()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for f, t in zip(fns, times, strict=True):
            start = time.perf_counter()
            f()
            t.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def _read_bandwidth_gbs() -> float:
    x = torch.ones(1 << 28)
    x.sum()
    start = time.perf_counter()
    for _ in range(3):
        x.sum()
    return 3 * x.numel() * 4 / (time.perf_counter() - start) / 1e9


def _resident_mb() -> float | None:
    """This process's resident memory in MB (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e6


def _compare(name: str, model: torch.nn.Module, inputs: list, args, weight_bytes: int) -> bool:
    """Compiles `model`, checks it against eager, prints both medians; False if wrong."""
    rss_before, start = _resident_mb(), time.perf_counter()
    compiled = ember.compile(model, *inputs, search_iterations=args.search, quiet=True)
    compile_s = time.perf_counter() - start
    rss_after = _resident_mb()
    grew = "—" if rss_before is None or rss_after is None else f"{rss_after - rss_before:.0f}"
    want, got = model(*inputs), compiled(*inputs)
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    err = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want, strict=True))
    scale = max(w.float().abs().max().item() for w in want)
    # 16-bit results differ from eager's by a few roundings of the largest value.
    ok = err <= (1e-4 if args.dtype == "f32" else 2e-2) * (1 + scale)
    ember_ms, eager_ms = _medians([lambda: compiled(*inputs), lambda: model(*inputs)], args.repeats)
    verdict = "" if ok else " WRONG"
    print(
        f"| {name} | {ember_ms:.2f} | {eager_ms:.2f} | {eager_ms / ember_ms:.2f}× | "
        f"{weight_bytes / ember_ms / 1e6:.1f} | {err:.1e}{verdict} | {compile_s:.1f} | {grew} |"
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--lengths", default="128,1024", help="decode cache lengths")
    p.add_argument("--prefill", type=int, default=0, help="prompt tokens (0: no prefill)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--search", type=int, default=0, help="Ember's search_iterations")
    p.add_argument("--tiny", action="store_true", help="a small config (to check the script)")
    args = p.parse_args(argv)
    dtype = DTYPES[args.dtype]
    cfg = dataclasses.replace(TINY if args.tiny else BILLION, layers=args.layers)
    torch.manual_seed(0)
    model = Llama(cfg).eval().to(dtype)
    for q in model.parameters():
        q.requires_grad_(False)
    weight_bytes = sum(q.numel() * q.element_size() for q in model.parameters())
    print(
        f"llama, {'tiny' if args.tiny else '1B'} shapes, {args.layers} layers, {args.dtype}: "
        f"{weight_bytes / 1e9:.2f} GB of weights; {torch.get_num_threads()} threads; "
        f"read bandwidth {_read_bandwidth_gbs():.1f} GB/s\n"
    )
    columns = ("run", "Ember ms", "eager ms", "vs eager", "Ember GB/s of weights", "max abs error")
    print("| " + " | ".join((*columns, "compile s", "compile MB")) + " |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    ok = True
    with torch.no_grad():
        step = LlamaDecodeStep(model).eval()
        token = torch.randint(0, cfg.vocab, (1, 1))
        for length in (int(n) for n in args.lengths.split(",") if n):
            cache = [c.to(dtype) for c in llama_cache(cfg, 1, length)]
            ok &= _compare(f"decode, cache {length}", step, [token, *cache], args, weight_bytes)
        if args.prefill:
            prompt = torch.randint(0, cfg.vocab, (1, args.prefill))
            ok &= _compare(f"prefill, {args.prefill} tokens", model, [prompt], args, weight_bytes)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
