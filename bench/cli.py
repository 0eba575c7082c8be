"""Command line of ``python3 -m bench``."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

import torch

from bench import backends, report, runner
from bench.cases import CASES

DEFAULT_OUT = Path(__file__).resolve().parent / "RESULTS.md"


def _models(value: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown model(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(CASES)}"
        )
    return names


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return n


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 -m bench",
        description="Time Ember against eager PyTorch, TorchInductor and ONNX Runtime on the "
        "CPU and write a Markdown report.",
    )
    parser.add_argument(
        "--models",
        type=_models,
        default=list(CASES),
        help=f"comma-separated models to run (default: {','.join(CASES)})",
    )
    parser.add_argument(
        "--threads",
        type=_positive,
        default=torch.get_num_threads(),
        help="CPU threads for every backend (default: torch.get_num_threads(), "
        f"{torch.get_num_threads()} here)",
    )
    parser.add_argument(
        "--rounds", type=_positive, help="round-robin timing rounds (default 5; 2 with --quick)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer, shorter repeats (smoke test)")
    parser.add_argument("--no-inductor", action="store_true", help="skip TorchInductor")
    parser.add_argument(
        "--no-optimizer",
        action="store_true",
        help="skip the optimizer comparison (Ember unoptimized and cost-model-only)",
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="Markdown report (default: bench/RESULTS.md)"
    )
    return parser.parse_args(argv)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = runner.QUICK if args.quick else runner.FULL
    settings = dataclasses.replace(
        settings, threads=args.threads, rounds=args.rounds or settings.rounds
    )
    chosen = backends.backends(inductor=not args.no_inductor, optimizer=not args.no_optimizer)
    command = shlex.join(["python3", "-m", "bench", *argv])

    load_before = report.machine_load()
    _log(f"machine load: {load_before}")
    results: list[runner.CaseResult] = []
    start = time.perf_counter()
    for name in args.models:
        case = CASES[name]
        _log(f"{case.title} ({name}):")
        results.append(runner.run_case(case, chosen, settings, _log))
        torch._dynamo.reset()  # drop Inductor's compiled graphs before the next model

    notes = report.existing_notes(args.out)
    text = report.render(results, settings, command, notes, load_before)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")

    for case_result in results:
        print(f"\n{case_result.case.title}\n")
        print("\n".join(report.table_lines(case_result)))
    print(f"\nWrote {args.out} in {time.perf_counter() - start:.0f} s.")
    return 0
