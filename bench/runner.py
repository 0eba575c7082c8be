"""Checking each backend against eager PyTorch, then timing the backends round-robin."""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bench.backends import Backend, first_line, flatten_outputs
from bench.cases import Case
from bench.generation import GenerationLoop

# An output counts as correct when max |out - eager| <= ATOL + RTOL * max |eager|. Backends
# reorder float32 sums (GEMM blocking, fused reductions), so they may differ from eager by
# rounding; a wrong result is off by the size of the output itself.
ATOL = 1e-4
RTOL = 1e-4


@dataclasses.dataclass(frozen=True)
class Settings:
    threads: int
    rounds: int
    warmup_calls: int  # at least this many warm-up calls...
    warmup_s: float  # ...and at least this long
    round_s: float  # each backend runs about this long per round
    min_calls: int  # calls per backend per round, at least...
    max_calls: int  # ...and at most


FULL = Settings(
    threads=1, rounds=5, warmup_calls=10, warmup_s=1.0, round_s=0.5, min_calls=10, max_calls=2000
)
QUICK = Settings(
    threads=1, rounds=2, warmup_calls=3, warmup_s=0.05, round_s=0.05, min_calls=3, max_calls=200
)


@dataclasses.dataclass
class Result:
    """One backend on one model. ``failure`` is set when it did not compile or run."""

    backend: str
    failure: str | None = None
    note: str = ""
    setup_s: float | None = None  # compile/export plus the first call
    max_abs_error: float | None = None
    valid: bool = False
    invalid_reason: str = ""
    calls_per_round: int = 0
    times_s: list[float] = dataclasses.field(default_factory=list)  # every timed call
    round_medians_s: list[float] = dataclasses.field(default_factory=list)

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.times_s) * 1e3 if self.times_s else None


@dataclasses.dataclass
class CaseResult:
    case: Case
    results: list[Result]

    def get(self, backend: str) -> Result | None:
        return next((r for r in self.results if r.backend == backend), None)


def _compare(out: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, bool, str]:
    """(max abs error, whether it is within tolerance, why not)."""
    if len(out) != len(ref):
        return math.nan, False, f"{len(out)} outputs, eager has {len(ref)}"
    err, scale = 0.0, 0.0
    for i, (o, r) in enumerate(zip(out, ref, strict=True)):
        if tuple(o.shape) != tuple(r.shape):
            return math.nan, False, f"output {i} has shape {list(o.shape)}, eager {list(r.shape)}"
        o, r = o.detach().double(), r.detach().double()
        if o.numel():
            err = max(err, (o - r).abs().max().item())
            scale = max(scale, r.abs().max().item())
    if not err <= ATOL + RTOL * scale:  # also catches NaN
        return err, False, f"max abs error {err:.2e} > tolerance {ATOL + RTOL * scale:.2e}"
    return err, True, ""


def _time_calls(call: Callable[[], Any], n: int, into: list[float]) -> None:
    for _ in range(n):
        start = time.perf_counter()
        call()
        into.append(time.perf_counter() - start)


def _warm_up(call: Callable[[], Any], settings: Settings) -> float:
    """Runs ``call`` until warm; returns its typical per-call time in seconds."""
    times: list[float] = []
    deadline = time.perf_counter() + settings.warmup_s
    while len(times) < settings.warmup_calls or time.perf_counter() < deadline:
        _time_calls(call, 1, times)
    return statistics.median(times[len(times) // 2 :])


def run_case(
    case: Case, backends: Sequence[Backend], settings: Settings, log: Callable[[str], None]
) -> CaseResult:
    torch.manual_seed(0)
    model, inputs = case.make()
    if isinstance(model, GenerationLoop):
        backends = [b for b in backends if b.runs_generation]
    results = [Result(b.name) for b in backends]
    calls: dict[str, Callable[[], Any]] = {}
    with torch.no_grad():
        ref = flatten_outputs(model(*inputs))
        for backend, result in zip(backends, results, strict=True):
            log(f"  {backend.name}: preparing")
            start = time.perf_counter()
            try:
                prepared = backend.prepare(model, inputs, settings.threads)
                out = flatten_outputs(prepared.call())
            except Exception as e:  # a backend that fails is reported, and the run goes on
                result.failure = f"{type(e).__name__}: {first_line(str(e))}"
                log(f"  {backend.name}: failed: {result.failure}")
                continue
            result.setup_s = time.perf_counter() - start
            result.note = prepared.note
            result.max_abs_error, result.valid, result.invalid_reason = _compare(out, ref)
            if not result.valid:
                log(f"  {backend.name}: WRONG OUTPUT: {result.invalid_reason}")
            calls[backend.name] = prepared.call

        for result in results:
            if result.backend in calls:
                per_call = _warm_up(calls[result.backend], settings)
                n = math.ceil(settings.round_s / max(per_call, 1e-9))
                result.calls_per_round = min(max(n, settings.min_calls), settings.max_calls)

        timed = [r for r in results if r.backend in calls]
        for round_ in range(settings.rounds):
            # Rotate the order each round so that no backend always runs right after another.
            shift = round_ % max(len(timed), 1)
            for result in timed[shift:] + timed[:shift]:
                gc.collect()
                times: list[float] = []
                _time_calls(calls[result.backend], result.calls_per_round, times)
                result.times_s += times
                result.round_medians_s.append(statistics.median(times))
            log(f"  round {round_ + 1}/{settings.rounds} done")
    return CaseResult(case, results)
