"""The Markdown report: machine, command, method and one table per model. Everything after
the ``<!-- notes -->`` line of an existing report is hand-written and kept across reruns."""

from __future__ import annotations

import datetime
import os
import platform
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import torch

from bench.runner import ATOL, RTOL, CaseResult, Result, Settings

NOTES_MARKER = "<!-- notes -->"
DEFAULT_NOTES = "## Notes\n\n_Hand-written analysis goes here; reruns keep it._\n"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat", encoding="utf-8") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields[:8]), fields[3] + fields[4]  # total, idle + iowait


def machine_load(seconds: float = 1.0) -> str:
    """How busy the whole machine was over the next ``seconds`` (before the benchmark starts,
    this is other processes' work), plus the load averages."""
    try:
        total0, idle0 = _cpu_times()
        time.sleep(seconds)
        total1, idle1 = _cpu_times()
        busy = 100.0 * (1 - (idle1 - idle0) / max(total1 - total0, 1))
        loads = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except (OSError, ValueError, IndexError):
        return "unknown"
    return f"{busy:.0f} % CPU busy over {seconds:g} s (load averages {loads})"


def machine_lines(threads: int, load_before: str) -> list[str]:
    import ember

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    cores = f"{os.cpu_count()} logical CPUs" + (
        f" ({affinity} usable by this process)" if affinity and affinity != os.cpu_count() else ""
    )
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [
        f"* CPU: {cpu_model()}, {cores}",
        f"* Threads: {threads} (torch intra-op, Ember `num_threads`, Inductor's kernels, "
        "ORT `intra_op_num_threads`)",
        f"* Versions: Python {platform.python_version()}, torch {torch.__version__}, "
        f"onnxruntime {_version('onnxruntime')}, onnx {_version('onnx')}, "
        f"onnxscript {_version('onnxscript')}, ember {ember.__version__}",
        f"* OS: {platform.platform()}",
        f"* Date: {now}",
        f"* Machine load just before the run: {load_before}; just after: {machine_load()}. "
        "Other work on the machine skews the timings (eager PyTorch's and Inductor's OpenMP "
        "threads the most).",
    ]


def method_lines(settings: Settings) -> list[str]:
    return [
        "Each model is built from a fixed seed, in eval mode, and run under `torch.no_grad()`. "
        "Every backend's outputs (all of them, e.g. logits and caches) are first compared with "
        f"eager PyTorch: an error above {ATOL:g} + {RTOL:g}·max|eager| marks the backend's time "
        "invalid. Each backend is then warmed up "
        f"(≥ {settings.warmup_calls} calls and ≥ {settings.warmup_s:g} s) and the backends are "
        f"timed round-robin for {settings.rounds} rounds, the order rotating each round; in a "
        f"round each backend runs about {settings.round_s:g} s worth of calls "
        f"({settings.min_calls}–{settings.max_calls}), each call timed with "
        "`time.perf_counter`. The median is over all timed calls.",
        "",
        "* Backends: **eager** PyTorch; **Ember** (`ember.compile(model, *inputs)`); "
        "**Inductor** (`torch.compile(model)`, default mode); **ORT** (ONNX Runtime, "
        "CPUExecutionProvider, the model exported by `torch.onnx.export(..., dynamo=True)` or "
        "the legacy exporter if that fails; inputs prepared once as NumPy arrays); "
        "**Ember (ONNX file)** (`ember.compile_onnx` on that same exported file, NumPy in "
        "and out); **Ember (unoptimized)** (`search_iterations=0`: the program as translated, "
        "no e-graph); **Ember (cost model)** (`search_iterations=1, cache=False`: the "
        "e-graph's cost-model choice, verified but not searched).",
        "* *vs eager* = eager median / backend median (> 1: faster than eager); "
        "*vs ORT* = backend median / ORT median (< 1: faster than ORT).",
        "* *Rounds* is the spread of the per-round medians (min–max); *setup* is "
        "compile/export time plus the first call (Inductor's may come from its on-disk cache of "
        "earlier runs).",
    ]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}×" if num and den else "—"


def table_lines(case_result: CaseResult) -> list[str]:
    eager = case_result.get("eager")
    ort = case_result.get("ORT")
    eager_ms = eager.median_ms if eager and eager.valid else None
    ort_ms = ort.median_ms if ort and ort.valid else None
    lines = [
        "| Backend | Median ms | vs eager | vs ORT | Max abs error | Rounds ms | Setup s | Calls |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes: list[str] = []
    for r in case_result.results:
        lines.append(_row(r, eager_ms, ort_ms))
        if r.note:
            notes.append(f"* {r.backend}: {_cell(r.note)}")
        if r.median_ms is not None and not r.valid:
            notes.append(f"* {r.backend}: **invalid output** — {_cell(r.invalid_reason)}")
    if case_result.case.tokens:
        rates = [
            f"{r.backend} {case_result.case.tokens / (r.median_ms / 1e3):.0f}"
            for r in case_result.results
            if r.median_ms is not None and r.valid
        ]
        notes.append(f"* Tokens/s (new tokens per second of the median call): {', '.join(rates)}")
    return lines + ([""] + notes if notes else [])


def optimizer_lines(results: Sequence[CaseResult]) -> list[str]:
    """What the optimizer gains per model: medians of the translated program, the
    cost-model choice and the searched choice, from the tables above (same run)."""
    names = ("Ember (unoptimized)", "Ember (cost model)", "Ember")
    rows = []
    for case_result in results:
        medians = []
        for name in names:
            r = case_result.get(name)
            medians.append(r.median_ms if r and r.valid and r.median_ms else None)
        if medians[0] is None:
            continue
        cells = [f"{m:.3f}" if m else "—" for m in medians]
        gains = [_ratio(medians[0], medians[1]), _ratio(medians[0], medians[2])]
        rows.append(f"| {case_result.case.title} | {' | '.join(cells)} | {' | '.join(gains)} |")
    if not rows:
        return []
    return [
        "",
        "### Optimizer",
        "",
        "Median ms of the same model without the optimizer, with the e-graph's cost-model "
        "choice only, and with measured search (Ember's default); *gain* = unoptimized median "
        "/ median (> 1: the optimizer made it faster).",
        "",
        "| Model | Unoptimized | Cost model | Searched | Cost-model gain | Search gain |",
        "|---|---:|---:|---:|---:|---:|",
        *rows,
    ]


def _row(r: Result, eager_ms: float | None, ort_ms: float | None) -> str:
    if r.failure is not None:
        return f"| {r.backend} | failed: {_cell(r.failure)} | — | — | — | — | — | — |"
    ms = r.median_ms
    err = f"{r.max_abs_error:.1e}" if r.max_abs_error is not None else "—"
    rounds = (
        f"{min(r.round_medians_s) * 1e3:.3g}–{max(r.round_medians_s) * 1e3:.3g}"
        if r.round_medians_s
        else "—"
    )
    setup = f"{r.setup_s:.1f}" if r.setup_s is not None else "—"
    calls = str(len(r.times_s))
    if ms is None:
        return f"| {r.backend} | — | — | — | {err} | — | {setup} | 0 |"
    if not r.valid:
        return (
            f"| {r.backend} | invalid ({ms:.3f}) | invalid | invalid | {err} | {rounds} | "
            f"{setup} | {calls} |"
        )
    vs_eager = _ratio(eager_ms, ms)
    vs_ort = _ratio(ms, ort_ms)
    return (
        f"| {r.backend} | {ms:.3f} | {vs_eager} | {vs_ort} | {err} | {rounds} | {setup} | {calls} |"
    )


def existing_notes(path: Path) -> str | None:
    """The hand-written part of an existing report (after the notes marker), if any."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.strip() == NOTES_MARKER:  # the marker alone on its line, not quoted in prose
            return "".join(lines[i + 1 :]).lstrip("\n")
    return None


def render(
    results: Sequence[CaseResult],
    settings: Settings,
    command: str,
    notes: str | None,
    load_before: str,
) -> str:
    lines = [
        "# Ember benchmarks (CPU)",
        "",
        f"Written by `python3 -m bench`. Everything above the `{NOTES_MARKER}` line is "
        "regenerated on each run; everything below it is kept.",
        "",
        "## Machine",
        "",
        *machine_lines(settings.threads, load_before),
        "",
        "Command:",
        "",
        "```bash",
        command,
        "```",
        "",
        "## Method",
        "",
        *method_lines(settings),
        "",
        "## Results",
    ]
    for case_result in results:
        case = case_result.case
        lines += ["", f"### {case.title}", "", case.description, "", *table_lines(case_result)]
    lines += optimizer_lines(results)
    lines += ["", NOTES_MARKER, ""]
    body = "\n".join(lines) + "\n"
    return body + (notes if notes is not None else DEFAULT_NOTES)
