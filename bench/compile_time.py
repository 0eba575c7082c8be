"""``python3 -m bench.compile_time``: how long Ember takes to compile a large model on the
CPU — the llama decode step of ``bench.gpu_llama`` at the 1B shapes (f32, random weights;
``--layers`` of them), compiled as a generation loop compiles it
(``torch.compile(step, backend="ember", dynamic=True)``), timed over its first call.

Two compiles in one process, both with an empty compile cache at first:

* *cold*: Dynamo's trace, ``torch.export``, Ember's translation and its compile (weights
  packed for the CPU's products), and the first run;
* *export cached*: the same after ``torch._dynamo.reset()``, the export now taken from the
  export cache the first compile stored (what a second process compiling the model pays).

Also printed: the process's peak resident memory before and after (``ru_maxrss``), against
the weights' own bytes — what compiling holds beside the model.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import tempfile
import time
from typing import Any

import ember
import torch
from ember.models import Llama, LlamaDecodeStep, llama_cache

from bench.gpu_llama import BILLION, TINY


def _peak_gb() -> float:
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


def _searched() -> str:
    """What the last search measured, when it ran."""
    report = ember.last_report()
    if report is None or not report.candidates:
        return ""
    if report.cache_hit:
        return "; search: the compile cache's choice"
    timed = sum(c.time_s is not None for c in report.candidates)
    return f"; search: {timed} candidates timed in {report.time_s:.1f} s"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--tiny", action="store_true", help="a small config (to check the script)")
    p.add_argument("--length", type=int, default=128, help="the cache length")
    p.add_argument(
        "--search",
        type=int,
        default=0,
        help="Ember's search_iterations (default 0: the program as translated)",
    )
    args = p.parse_args(argv)
    cfg = dataclasses.replace(TINY if args.tiny else BILLION, layers=args.layers)
    torch.manual_seed(0)
    model = Llama(cfg).eval()
    for q in model.parameters():
        q.requires_grad_(False)
    weight_gb = sum(q.numel() * q.element_size() for q in model.parameters()) / 1e9
    step = LlamaDecodeStep(model).eval()
    token = torch.randint(0, cfg.vocab, (1, 1))
    cache = llama_cache(cfg, 1, args.length)
    options = {"search_iterations": args.search, "quiet": True}
    print(
        f"llama decode step, {'tiny' if args.tiny else '1B'} shapes, {args.layers} layers, "
        f"f32: {weight_gb:.2f} GB of weights; search_iterations={args.search}; "
        f"{torch.get_num_threads()} threads"
    )
    saved = os.environ.get("EMBER_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache_dir, torch.no_grad():
        os.environ["EMBER_CACHE_DIR"] = cache_dir
        try:
            wrong = _compile_twice(step, (token, *cache), options)
        finally:
            if saved is None:
                del os.environ["EMBER_CACHE_DIR"]
            else:
                os.environ["EMBER_CACHE_DIR"] = saved
    return 1 if wrong else 0


def _compile_twice(
    step: torch.nn.Module, inputs: tuple[torch.Tensor, ...], options: dict[str, Any]
) -> int:
    """Compiles and calls `step` twice (cold, then with the export cached), printing each
    first call's time; returns how many results differed from eager."""
    want = step(*inputs)[0]
    tolerance = 1e-4 * (1 + want.abs().max().item())
    wrong = 0
    for label in ("cold", "export cached"):
        torch._dynamo.reset()
        before = _peak_gb()
        fn = torch.compile(step, backend="ember", dynamic=True, options=options)
        start = time.perf_counter()
        got = fn(*inputs)[0]
        seconds = time.perf_counter() - start
        err = (got - want).abs().max().item()
        print(
            f"{label}: first call {seconds:.1f} s; peak memory {before:.1f} → "
            f"{_peak_gb():.1f} GB; max |error| vs eager {err:.1e}{_searched()}"
        )
        wrong += err > tolerance
        del fn, got
    return wrong


if __name__ == "__main__":
    raise SystemExit(main())
