"""``python3 -m bench.gpu_profile``: where Ember's time goes on the GPU, for the llama
benchmark's shapes (``bench.gpu_llama``) with fewer layers (compiles in seconds): prefill
and one-token decode, each profiled with ``torch.profiler`` (CUPTI sees Ember's kernels,
also inside its CUDA graphs). Prints the kernels that take the most device time, the run
statistics (graph replays, recordings, patches) and the wall time per call, with CUDA
graphs on and off (``EMBER_CUDA_GRAPHS=0``), and each product shape's measured kernels
(cuBLASLt's algorithms and cuBLAS, ``ember.cuda.product_tuning``). ``--ir DIR`` also
writes each program's IR.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
import time
from collections.abc import Callable
from typing import Any

import ember
import torch
from ember.models import Llama, LlamaDecodeStep, llama_cache

from bench.gpu_llama import BILLION


def _wall_ms(fn: Callable[[], Any], repeats: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def _profile(label: str, fn: Callable[[], Any], rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events) / 3
    print(f"\n{label}: {total / 1e3:.3f} ms of device time a call (3 calls)")
    for e in events[:rows]:
        name = e.key if len(e.key) <= 90 else e.key[:87] + "..."
        print(f"  {e.device_time_total / 3 / 1e3:9.3f} ms  {e.count // 3:5d}×  {name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--lengths", default="128,1024", help="decode's cache lengths")
    p.add_argument("--rows", type=int, default=14)
    p.add_argument("--ir", default=None, help="a folder for each program's IR")
    args = p.parse_args(argv)
    cfg = dataclasses.replace(BILLION, layers=args.layers)
    lengths = [int(n) for n in args.lengths.split(",")]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Llama(cfg).to(torch.bfloat16).eval()
    for q in model.parameters():
        q.requires_grad_(False)
    step = LlamaDecodeStep(model).eval()
    ids = torch.randint(0, cfg.vocab, (1, args.prompt), device="cuda")
    token = torch.randint(0, cfg.vocab, (1, 1), device="cuda")
    cache = [t.to("cuda", torch.bfloat16) for t in llama_cache(cfg, 1, max(lengths))]
    print(f"{torch.cuda.get_device_name(0)}; llama dims of bench.gpu_llama, {cfg.layers} layers")

    # Each case: inputs to rotate through, call by call. A generation loop hands over a new
    # cache every step, whose addresses are new to the recording (patched in each call):
    # "new buffers" alternates between two copies of the cache to show what that costs.
    copy = tuple(t.clone() for t in cache)
    cases: list[tuple[str, torch.nn.Module, list[tuple[torch.Tensor, ...]]]] = [
        (f"prefill {args.prompt}", model, [(ids,)]),
        *[
            (f"decode at {n}", step, [(token, *[t[:, :, :n].contiguous() for t in cache])])
            for n in lengths
        ],
        (f"decode at {lengths[-1]}, new buffers", step, [(token, *cache), (token, *copy)]),
    ]
    with torch.no_grad():
        for label, module, input_sets in cases:
            first = input_sets[0]
            eager_ms = _wall_ms(lambda m=module, x=first: m(*x), 10)
            print(f"\n== {label}: eager {eager_ms:.3f} ms a call (wall)")
            for graphs in ("1", "0"):
                os.environ["EMBER_CUDA_GRAPHS"] = graphs
                start = time.perf_counter()
                compiled = ember.compile(module, *first, quiet=True, search_iterations=0)
                compiled(*first)
                compile_s = time.perf_counter() - start
                turn = itertools.count()

                def call(c=compiled, sets=input_sets, turn=turn) -> Any:
                    return c(*sets[next(turn) % len(sets)])

                ms = _wall_ms(call, 10)
                print(
                    f"ember (graphs {'on' if graphs == '1' else 'off'}): {ms:.3f} ms a call "
                    f"(wall), compiled in {compile_s:.1f} s; {compiled.run_stats()}"
                )
                _profile(f"ember {label} graphs={graphs}", call, args.rows)
                if args.ir and graphs == "1" and len(input_sets) == 1:
                    os.makedirs(args.ir, exist_ok=True)
                    path = os.path.join(args.ir, label.replace(" ", "_") + ".ir.txt")
                    with open(path, "w") as f:
                        f.write(compiled.ir())
                del compiled
            _profile(f"eager {label}", lambda m=module, x=first: m(*x), 8)
    os.environ.pop("EMBER_CUDA_GRAPHS", None)
    _print_product_tuning()
    return 0


def _print_product_tuning() -> None:
    """Each product shape's measured kernels (``ember.cuda.product_tuning``): the chosen
    one's time, and the rate at which it reads its operands (the weights, in a decode
    step: what sets the floor)."""
    tunings = ember.cuda.product_tuning()
    print(f"\n== products measured: {len(tunings)} shapes (median µs, L2 flushed)")
    for t in tunings:
        times = dict(t["candidates"])
        best = times.get(t["chosen"])
        shown = ", ".join(
            f"{name} {'failed' if us is None else f'{us:.1f}'}" for name, us in t["candidates"]
        )
        print(f"  {t['product']}: {t['chosen']} {_rate(t['product'], best)} ← {shown}")


def _rate(product: str, us: float | None) -> str:
    """GB/s read and written by a product described as ``"bfloat16 [m×k]·[k×n] ..."``."""
    match = re.match(r"(\w+) \[(\d+)×(\d+)\]·\[\d+×(\d+)\](?: ×(\d+))?", product)
    if us is None or not match:
        return ""
    dtype, m, k, n, batch = match.groups()
    size = {"float64": 8, "float32": 4}.get(dtype, 2)
    m, k, n, batch = int(m), int(k), int(n), int(batch or 1)
    moved = batch * (m * k + k * n + m * n) * size
    return f"{us:.1f} µs ({moved / (us * 1e-6) / 1e9:.0f} GB/s)"


if __name__ == "__main__":
    raise SystemExit(main())
