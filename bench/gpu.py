"""``python3 -m bench.gpu``: the benchmark cases on an NVIDIA GPU — Ember (device="cuda")
against eager PyTorch and TorchInductor (default and ``mode="reduce-overhead"``), in the same
run. Times are medians of repeats, each call followed by ``torch.cuda.synchronize()``.

First version: it measures what the CUDA backend does today (one launch per kernel, host
round trips for the dims and the error flag); issue 7 tracks making it fast.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import ember
import torch

from bench.cases import CASES

GPU_CASES = ("mlp", "prefill", "decode", "chain", "cnn")


def _median_ms(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _runners(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> dict[str, Callable]:
    runners: dict[str, Callable] = {"eager": lambda: model(*inputs)}
    compiled = ember.compile(model, *inputs, device="cuda", quiet=True)
    runners["ember"] = lambda: compiled(*inputs)
    for label, mode in (("inductor", None), ("inductor-ro", "reduce-overhead")):
        fn = torch.compile(model, mode=mode)
        runners[label] = lambda fn=fn: fn(*inputs)
    return runners


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", default=",".join(GPU_CASES))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if not ember.cuda_available():
        print("no usable NVIDIA GPU: nothing to measure")
        return 1
    rows = []
    for name in args.models.split(","):
        model, inputs = CASES[name].make()
        model = model.cuda()
        inputs = tuple(t.cuda() for t in inputs)
        row: dict[str, Any] = {"case": name}
        with torch.no_grad():
            expected = model(*inputs)
            for label, fn in _runners(model, inputs).items():
                try:
                    got = fn()
                    if label == "ember":
                        want = expected[0] if isinstance(expected, tuple) else expected
                        have = got[0] if isinstance(got, tuple | list) else got
                        row["ember_max_abs_err"] = float((have - want).abs().max())
                    row[label] = _median_ms(fn, args.warmup, args.repeats)
                except Exception as e:  # a failing runner is reported, not fatal
                    row[label] = None
                    row[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        torch._dynamo.reset()
    device = torch.cuda.get_device_name(0)
    print(f"device: {device}; torch {torch.__version__}; median ms of {args.repeats}")
    labels = ("eager", "inductor", "inductor-ro", "ember")
    print("| case | " + " | ".join(labels) + " | ember vs eager | max abs err |")
    print("|---" * (len(labels) + 3) + "|")
    for r in rows:
        cells = [f"{r[k]:.3f}" if r.get(k) is not None else "error" for k in labels]
        speed = f"{r['eager'] / r['ember']:.2f}×" if r.get("ember") and r.get("eager") else "–"
        err = f"{r['ember_max_abs_err']:.1e}" if "ember_max_abs_err" in r else "–"
        print(f"| {r['case']} | " + " | ".join(cells) + f" | {speed} | {err} |")
        for k, v in r.items():
            if k.endswith("_error"):
                print(f"  {r['case']} {k}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "rows": rows}, f, indent=1)
    return 0 if all(r.get("ember") is not None for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
