"""``python3 -m bench.elementwise``: every unary op Ember runs on f32, one op a program, against
eager in the same process — medians of ``--repeats`` calls, alternating the two, each checked
against eager first. Prints a Markdown table.

The models in ``python3 -m bench`` touch a handful of ops (exp, tanh, GELU); this is where an
op that runs one element at a time (libm) instead of a vector kernel shows up. The times
include Ember's per-call overhead (reading the inputs, allocating the output: ~5-10 µs), which
dominates the cheap ops at small sizes; ``--rows`` makes the tensors bigger.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import ember
import torch
import torch.nn.functional as F

# Each op and the inputs it is timed on: the whole real line, or positive values only.
OPS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], bool]] = {
    "abs": (torch.abs, False),
    "cos": (torch.cos, False),
    "erf": (torch.erf, False),
    "exp": (torch.exp, False),
    "expm1": (torch.expm1, False),
    "gelu": (F.gelu, False),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), False),
    "log": (torch.log, True),
    "log1p": (torch.log1p, True),
    "neg": (torch.neg, False),
    "reciprocal": (torch.reciprocal, True),
    "relu": (torch.relu, False),
    "rsqrt": (torch.rsqrt, True),
    "sigmoid": (torch.sigmoid, False),
    "silu": (F.silu, False),
    "sin": (torch.sin, False),
    "sqrt": (torch.sqrt, True),
    "tan": (torch.tan, False),
    "tanh": (torch.tanh, False),
}


class _Op(torch.nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _medians_us(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median µs of each function, in batches of 20 calls alternating between them."""
    for f in fns:
        for _ in range(50):
            f()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(max(1, repeats // 20)):
        for f, t in zip(fns, times, strict=True):
            for _ in range(20):
                start = time.perf_counter()
                f()
                t.append((time.perf_counter() - start) * 1e6)
    return [statistics.median(t) for t in times]


def time_op(name: str, rows: int, threads: int, repeats: int) -> tuple[float, float, float]:
    """(Ember µs, eager µs, max abs error) of op `name` on a random [rows, 512] input; raises
    SystemExit where Ember's result differs from eager's."""
    fn, positive = OPS[name]
    x = torch.randn(rows, 512)
    if positive:
        x = x.abs() + 0.05
    with torch.no_grad():
        fast = ember.compile(_Op(fn).eval(), x, num_threads=threads)
        want = fn(x)
        err = (fast(x) - want).abs().max().item()
        tol = 1e-5 + 1e-5 * want.abs().max().item()
        if not err <= tol:
            raise SystemExit(f"{name}: Ember differs from eager by {err:.2e} (> {tol:.1e})")
        ours, eager = _medians_us([lambda: fast(x), lambda: fn(x)], repeats)
    return ours, eager, err


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="input [rows, 512] (default 64)")
    parser.add_argument("--threads", type=int, default=1, help="threads for both (default 1)")
    parser.add_argument("--repeats", type=int, default=2000, help="timed calls of each")
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated ops")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"f32 [{args.rows}, 512], {args.threads} thread(s), torch {torch.__version__}\n")
    print("| Op | Ember µs | eager µs | vs eager | max abs error |")
    print("|---|---:|---:|---:|---:|")
    for name in args.ops.split(","):
        ours, eager, err = time_op(name, args.rows, args.threads, args.repeats)
        print(f"| {name} | {ours:.1f} | {eager:.1f} | {eager / ours:.2f}× | {err:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
