"""``python3 -m bench.gpu_llama``: a llama-style model of about 1B parameters (random
weights, bf16) on an NVIDIA GPU — one-token decode latency with a KV cache at several
lengths, and prefill throughput — Ember against eager PyTorch and TorchInductor (default
and ``mode="reduce-overhead"``), all in the same run.

Decode is bound by memory bandwidth: each token reads every weight once. The *floor* is
the weight bytes a step reads (all but the embedding table, of which it reads one row)
divided by the device's copy bandwidth measured here (a large device-to-device copy);
"of floor" is floor time / measured time (1.0 would be reading the weights at copy speed).

Errors are the largest absolute difference of each backend's bf16 logits from an f32 run of
the same (bf16-rounded) weights; eager's bf16 error is the yardstick.

Times are medians of repeats, each timed with CUDA events around one call. Every backend
compiles the decode step once with dynamic shapes (``torch.compile(..., dynamic=True)``),
so one program serves every cache length. Ember runs without its measured search by default
(``--ember-search 0``) and with it as the ``ember-search`` runner: the search verifies
every candidate against the reference interpreter on the host (about a second at this
size since stop 36, minutes before; prefill is verified at a few tokens).
``ember-warp`` / ``ember-thread`` runners force a generated product kernel for every
product instead of cuBLASLt (what the search would weigh); ``ember-simt-attention`` runs
prefill attention off the tensor cores. Results print as they come (a run cut short still
leaves its rows) and go to ``--json``.

``--tiny --device cpu`` runs a small config on the CPU, to check the script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import ember
import torch
from ember.backend import live_programs
from ember.models import Llama, LlamaConfig, LlamaDecodeStep, llama_cache

# Llama-3.2-1B's shape with a 32k vocabulary: 1.1B parameters.
BILLION = LlamaConfig(
    vocab=32000, dim=2048, layers=16, heads=32, kv_heads=8, hidden=8192, max_seq=4096
)
TINY = LlamaConfig(vocab=512, dim=128, layers=2, heads=4, kv_heads=2, hidden=256, max_seq=512)
RUNNERS = ("eager", "inductor", "inductor-ro", "ember", "ember-warp")
# ``ember-search``: Ember with its measured search (at least this many candidates; more
# with ``--ember-search``), the choices it makes on the GPU (cuBLASLt or a generated
# product kernel, merged projections) verified against the reference interpreter (for
# prefill at fewer tokens than timed: ``search.rs`` ``REFERENCE_TERMS``).
SEARCHED = 8
# Ember with a kernel choice forced by its environment variable: a generated product kernel
# for every product cuBLASLt would take (``EMBER_CUDA_PRODUCTS``: what the search would
# measure, without its minutes at 1B), or prefill attention off the tensor cores
# (``EMBER_CUDA_MMA_ATTENTION=0``: what the tensor-core kernel gains).
FORCED = {
    "ember-warp": ("EMBER_CUDA_PRODUCTS", "cuda.warp_dot"),
    "ember-thread": ("EMBER_CUDA_PRODUCTS", "cuda.thread_dot"),
    "ember-simt-attention": ("EMBER_CUDA_MMA_ATTENTION", "0"),
    # One product library for every product, unmeasured (``products.rs``): what measuring
    # each shape's kernel among both gains.
    "ember-cublaslt": ("EMBER_CUDA_PRODUCT_LIBRARY", "cublaslt"),
    "ember-cublas": ("EMBER_CUDA_PRODUCT_LIBRARY", "cublas"),
}


class Timer:
    """Median milliseconds of a call: CUDA events on the GPU, the wall clock on the CPU."""

    def __init__(self, device: str, warmup: int, repeats: int) -> None:
        self.device, self.warmup, self.repeats = device, warmup, repeats

    def median_ms(self, fn: Callable[[], Any]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            if self.device == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def copy_bandwidth_gbs(device: str, timer: Timer) -> float:
    """Device copy bandwidth (read + write bytes per second) of a 1 GiB copy (64 MiB on
    the CPU)."""
    n = (1 << 30) if device == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer.median_ms(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3) / 1e9


def decode_weight_bytes(model: Llama) -> int:
    """Bytes of weights one decode step reads: every parameter but the embedding table."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - model.embed.weight.numel() * model.embed.weight.element_size()


def _compiled(
    fn: torch.nn.Module, label: str, device: str, search: int = 0, budget_s: float = 120.0
) -> Callable:
    if label == "eager":
        return fn
    if label in ("ember", "ember-search") or label in FORCED:
        # The budget counts the reference run the search verifies against (a second or so
        # at 1B on the host), so the default 3 s would leave little time to measure.
        options: dict[str, Any] = {
            "search_iterations": max(search, SEARCHED) if label == "ember-search" else search,
            "time_budget_s": budget_s,
            "quiet": True,
        }
        compiled = torch.compile(fn, backend="ember", dynamic=True, options=options)
        if label in ("ember", "ember-search"):
            return compiled
        return _with_env(compiled, *FORCED[label])
    mode = "reduce-overhead" if label == "inductor-ro" else None
    return torch.compile(fn, mode=mode, dynamic=True)


def _with_env(fn: Callable, name: str, value: str) -> Callable:
    """`fn` with the environment variable `name` set to `value` while it runs: Ember reads
    it whenever it compiles, which happens inside a call (the first, and any recompile torch
    asks for). Setting it costs about a microsecond a call, inside the timed region."""

    def call(*args: Any) -> Any:
        before = os.environ.get(name)
        os.environ[name] = value
        try:
            return fn(*args)
        finally:
            if before is None:
                del os.environ[name]
            else:
                os.environ[name] = before

    return call


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:240] if str(e) else ''}"


# Ember's programs by runner (those its first call built), for their run statistics.
_PROGRAMS: dict[str, list[Any]] = {}


def _run_stats(label: str) -> str:
    """The runner's Ember programs' run statistics, summed, per timed call: how many
    programs (more than one means graph breaks), and the host time a call spends."""
    programs = _PROGRAMS.get(label, [])
    if not programs:
        return ""
    total: dict[str, int] = {}
    for p in programs:
        for k, v in p.run_stats().items():
            total[k] = total.get(k, 0) + v
    runs = max(total.get("replayed", 0) + total.get("direct", 0), 1)
    per_run = ", ".join(f"{k} {v / runs:.1f}" for k, v in sorted(total.items()) if v)
    return f"; {len(programs)} program(s)" + (f", per run: {per_run}" if per_run else "")


def _search_summary(label: str) -> str:
    """What the measured search of the runner's programs chose, and what it timed (µs):
    `; search: chose <change> | <candidate> <µs>, ...` (or the choice the compile cache
    held); empty where the optimizer did not run."""
    parts = []
    for p in _PROGRAMS.get(label, []):
        report = p.report()
        if report.chosen is None or not report.candidates:
            continue
        chosen = report.candidates[report.chosen].description[:80]
        timed = [c for c in report.candidates if c.time_s is not None]
        if report.cache_hit:
            parts.append(f"chose {chosen} (from the compile cache)")
        elif timed:
            times = ", ".join(f"{c.description[:60]} {c.time_s * 1e6:.0f}" for c in timed)
            parts.append(f"chose {chosen} | {times}")
    return "; search: " + "; ".join(parts) if parts else ""


def _measure(
    row: dict[str, Any], label: str, call: Callable[[], Any], want: torch.Tensor, timer: Timer
) -> bool:
    """Records `label`'s error against `want` (the first output's, in f32) and its median
    time in `row`; a failing runner is recorded as an error, not raised."""
    try:
        before = live_programs()  # held, so no new program can take an old one's id
        start = time.perf_counter()
        got = call()
        first_s = time.perf_counter() - start
        new = [p for p in live_programs() if all(p is not q for q in before)]
        del before
        _PROGRAMS.setdefault(label, []).extend(new)
        got = (got[0] if isinstance(got, tuple | list) else got).float()
        row[f"{label}_max_abs_err"] = float((got - want).abs().max())
        row[label] = timer.median_ms(call)
        # A progress line per runner: a run cut short by its time limit still shows these.
        print(
            f"  {label}: {row[label]:.3f} ms (first call {first_s:.1f} s), "
            f"max abs err {row[f'{label}_max_abs_err']:.3g}{_run_stats(label)}"
            f"{_search_summary(label)}",
            flush=True,
        )
        return True
    except Exception as e:
        row[label] = None
        row[f"{label}_error"] = _error(e)
        print(f"  {label}: {row[f'{label}_error']}", flush=True)
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="a small config (checks the script)")
    p.add_argument("--lengths", default="128,1024", help="KV cache lengths of the decode step")
    p.add_argument("--prompt", type=int, default=512, help="prefill prompt length (0: none)")
    p.add_argument(
        "--runners",
        default=",".join(RUNNERS),
        help=f"of {', '.join(dict.fromkeys(RUNNERS + ('ember-search',) + tuple(FORCED)))}",
    )
    p.add_argument(
        "--ember-search",
        type=int,
        default=0,
        help="Ember's search_iterations (0: none; each candidate is verified on the host)",
    )
    p.add_argument(
        "--ember-budget",
        type=float,
        default=120.0,
        help="Ember's time_budget_s when searching (the reference run counts against it)",
    )
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    device = args.device
    if device == "cuda" and not (torch.cuda.is_available() and ember.cuda_available()):
        print("no usable NVIDIA GPU: nothing to measure")
        return 1
    cfg = TINY if args.tiny else BILLION
    dtype = torch.bfloat16
    timer = Timer(device, args.warmup, args.repeats)
    runners = [r for r in args.runners.split(",") if r]
    lengths = [int(n) for n in args.lengths.split(",") if n]

    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg).to(dtype).eval()
    for q in model.parameters():
        q.requires_grad_(False)
    params = sum(q.numel() for q in model.parameters())
    weight_bytes = decode_weight_bytes(model)
    bandwidth = copy_bandwidth_gbs(device, timer)
    floor_ms = weight_bytes / (bandwidth * 1e9) * 1e3
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    result: dict[str, Any] = {
        "device": name,
        "torch": torch.__version__,
        "params": params,
        "decode_weight_bytes": weight_bytes,
        "copy_bandwidth_gbs": bandwidth,
        "floor_ms": floor_ms,
        "decode": [],
        "prefill": [],
    }

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    print(
        f"device: {name}; torch {torch.__version__}; {params / 1e6:.1f}M parameters, bf16; "
        f"decode reads {weight_bytes / 1e9:.2f} GB of weights; copy bandwidth "
        f"{bandwidth:.0f} GB/s → floor {floor_ms:.3f} ms/token; median of {args.repeats}"
    )
    save()

    # The reference: the same weights in f32 (the difference is the bf16 arithmetic alone).
    with torch.device(device):
        model32 = Llama(cfg).eval()
    model32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    step = LlamaDecodeStep(model).eval()
    step32 = LlamaDecodeStep(model32).eval()
    print("\n| decode (cache length) | " + " | ".join(f"{r} ms" for r in runners) + " |")
    print("|---" * (len(runners) + 1) + "|")
    decode_fns = {
        label: _compiled(step, label, device, args.ember_search, args.ember_budget)
        for label in runners
    }
    with torch.no_grad():
        for length in lengths:
            token = torch.randint(0, cfg.vocab, (1, 1), device=device)
            cache = [t.to(device, dtype) for t in llama_cache(cfg, 1, length)]
            want = step32(token, *[c.float() for c in cache])[0]
            row: dict[str, Any] = {"length": length}
            for label, fn in decode_fns.items():
                call = lambda fn=fn, t=token, c=cache: fn(t, *c)  # noqa: E731
                if _measure(row, label, call, want, timer):
                    row[f"{label}_of_floor"] = floor_ms / row[label]
            result["decode"].append(row)
            save()
            cells = [
                f"{row[r]:.3f} ({row[f'{r}_of_floor']:.0%} of floor)" if row.get(r) else "error"
                for r in runners
            ]
            print(f"| {length} | " + " | ".join(cells) + " |")
    del decode_fns, step32
    _PROGRAMS.clear()  # (each holds its copy of the weights on the GPU)
    torch._dynamo.reset()

    if args.prompt > 0:
        heads = " | ".join(f"{r} ms" for r in runners)
        print(f"\n| prefill ({args.prompt} tokens) | {heads} |")
        print("|---" * (len(runners) + 1) + "|")
        ids = torch.randint(0, cfg.vocab, (1, args.prompt), device=device)
        row = {"prompt": args.prompt}
        with torch.no_grad():
            want = model32(ids)
            for label in runners:
                fn = _compiled(model, label, device, args.ember_search, args.ember_budget)
                if _measure(row, label, lambda fn=fn: fn(ids), want, timer):
                    row[f"{label}_tokens_per_s"] = args.prompt / (row[label] * 1e-3)
                _PROGRAMS.clear()
                torch._dynamo.reset()
        result["prefill"].append(row)
        save()
        cells = [
            f"{row[r]:.2f} ({row[f'{r}_tokens_per_s']:.0f} tok/s)" if row.get(r) else "error"
            for r in runners
        ]
        print(f"| {args.prompt} | " + " | ".join(cells) + " |")

    for part in ("decode", "prefill"):
        for row in result[part]:
            for k, v in row.items():
                if k.endswith("_error") or k.endswith("_max_abs_err"):
                    print(f"  {part} {row.get('length', row.get('prompt'))} {k}: {v}")
    # Failed where an Ember runner asked for failed (others' failures are their own).
    ember_runners = [r for r in runners if r.startswith("ember")]
    rows = result["decode"] + result["prefill"]
    ok = all(row.get(r) is not None for row in rows for r in ember_runners)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
