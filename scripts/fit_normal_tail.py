"""Fits `GELU_TAIL_POLY` (rust/cpu/src/elem/fastmath.rs): the standard normal tail
Q(a) = erfc(a/√2)/2 on [0, 6) in eight pieces of width 0.75, each a degree-7 polynomial in
the offset from the piece's center, and prints the table and its error in float32.

Each piece is a least-squares fit of Q's relative error on Chebyshev points, reweighted a
few dozen times toward the worst points (Lawson's method), so it ends close to the
minimax fit. Run: `python3 scripts/fit_normal_tail.py` (NumPy only).
"""

from __future__ import annotations

import math

import numpy as np

PIECE = 0.75
PIECES = 8
DEGREE = 7


def tail(a: float) -> float:
    return 0.5 * math.erfc(a / math.sqrt(2.0))


def fit_piece(center: float) -> list[float]:
    t = np.cos(np.linspace(0.0, math.pi, 400)) * PIECE / 2
    q = np.array([tail(center + v) for v in t])
    powers = np.vander(t, DEGREE + 1)  # highest power first, as the kernels evaluate
    weight = np.ones_like(t)
    for _ in range(30):
        rows = powers * (weight / q)[:, None]
        coef = np.linalg.lstsq(rows, weight, rcond=None)[0]
        rel = np.abs(powers @ coef - q) / q
        weight *= np.sqrt(rel / rel.mean() + 1e-3)
    return [float(np.float32(c)) for c in coef]


def evaluate(table: list[list[float]], a: float) -> float:
    """Q(a) as the kernels compute it (float32 Horner steps; fused multiply-adds)."""
    f32 = np.float32
    ac = min(f32(a), f32(PIECES * PIECE))
    piece = min(int(f32(ac * f32(1 / PIECE))), PIECES - 1)
    t = f32(ac - f32(piece * PIECE + PIECE / 2))
    q = f32(table[piece][0])
    for c in table[piece][1:]:
        q = f32(float(q) * float(t) + c)
    return 0.0 if a >= PIECES * PIECE else float(q)


def main() -> None:
    table = [fit_piece((i + 0.5) * PIECE) for i in range(PIECES)]
    print(f"pub const GELU_TAIL_POLY: [[f32; {PIECES}]; {DEGREE + 1}] = [")
    for k in range(DEGREE + 1):
        row = ", ".join(np.format_float_scientific(np.float32(p[k]), unique=True) for p in table)
        print(f"    [{row}],")
    print("];")
    for i in range(PIECES):
        grid = np.linspace(i * PIECE, (i + 1) * PIECE, 2001, endpoint=False)
        errors = [(abs(evaluate(table, a) - tail(a)), tail(a)) for a in grid]
        worst_abs = max(e for e, _ in errors)
        worst_rel = max(e / q for e, q in errors)
        print(f"piece {i}: max |error| {worst_abs:.1e}, max relative error {worst_rel:.1e}")


if __name__ == "__main__":
    main()
