"""Where a compiled CPU program spends its time, step by step.

    with ember.profile_cpu() as prof:
        for _ in range(100):
            compiled(x)
    print(prof)            # slowest steps first, by op and output shape

Timing is per step of the program as it runs (a fused group, a `dot`, an attention, a
copy), wall clock on the calling thread; steps that use several threads count once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ember import _core


@dataclass(frozen=True)
class ProfileRow:
    label: str
    shape: tuple[int, ...]
    seconds: float
    steps: int


@dataclass
class CpuProfile:
    """Per-step totals gathered inside `profile_cpu()`, slowest first."""

    rows: list[ProfileRow] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return sum(r.seconds for r in self.rows)

    def by_label(self) -> dict[str, float]:
        """Seconds per op label (all shapes together), slowest first."""
        sums: dict[str, float] = {}
        for r in self.rows:
            sums[r.label] = sums.get(r.label, 0.0) + r.seconds
        return dict(sorted(sums.items(), key=lambda kv: -kv[1]))

    def __str__(self) -> str:
        total = self.total_s or 1.0
        head = f"{'step':34s} {'output shape':>20s} {'total ms':>10s} {'share':>6s} {'steps':>7s}"
        lines = [head]
        for r in self.rows:
            shape = "[" + ", ".join(map(str, r.shape)) + "]"
            lines.append(
                f"{r.label:34s} {shape:>20s} {r.seconds * 1e3:10.2f} "
                f"{r.seconds / total:6.1%} {r.steps:7d}"
            )
        return "\n".join(lines)


@contextmanager
def profile_cpu() -> Iterator[CpuProfile]:
    """Times every step of the CPU programs run inside the block (any compiled model)."""
    result = CpuProfile()
    _core.cpu_profile_take()  # drop anything gathered outside a block
    _core.cpu_profile_enable(True)
    try:
        yield result
    finally:
        _core.cpu_profile_enable(False)
        result.rows = [
            ProfileRow(label, tuple(shape), seconds, steps)
            for label, shape, seconds, steps in _core.cpu_profile_take()
        ]
