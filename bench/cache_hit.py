"""``python3 -m bench.cache_hit``: the compile cache seen from a second process.

For each benchmark model, two fresh processes compile it with the same, initially empty
``EMBER_CACHE_DIR``: the first searches and stores its choice, the second should find it.
Prints a Markdown table of both processes' optimizer time (``report().time_s``: e-graph,
search or cache lookup, verification) and whole ``ember.compile`` time (export or export-cache
lookup, translation, optimizer, backend compile), whether the second process hit both caches,
and whether both run the same program.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = """
import json, sys, time, torch
from bench.cases import CASES
import ember
torch.set_num_threads({threads})
model, inputs = CASES[{name!r}].make()
start = time.perf_counter()
compiled = ember.compile(model, *inputs, num_threads={threads}, quiet=True)
total = time.perf_counter() - start
r = compiled.report()
print(json.dumps({{"total_s": total, "optimizer_s": r.time_s, "hit": r.cache_hit,
                  "export_hit": r.export_cache_hit, "program": compiled.ir()}}))
"""

CASES = ("mlp", "prefill", "decode", "chain", "cnn")


def _compile_in_child(name: str, threads: int, cache_dir: str) -> dict:
    env = dict(os.environ, EMBER_CACHE_DIR=cache_dir)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD.format(name=name, threads=threads)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{name}: compiling in a child process failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    args = parser.parse_args(argv)
    print(
        "| Model | 1st: optimizer s | 2nd: optimizer s | optimizer speed-up "
        "| 1st: compile s | 2nd: compile s | compile speed-up "
        "| 2nd hit: choice / export | same program |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    for name in args.cases:
        with tempfile.TemporaryDirectory(prefix="ember-cache-") as cache_dir:
            first = _compile_in_child(name, args.threads, cache_dir)
            second = _compile_in_child(name, args.threads, cache_dir)
        speedup = first["optimizer_s"] / max(second["optimizer_s"], 1e-9)
        print(
            f"| {name} | {first['optimizer_s']:.2f} | {second['optimizer_s']:.2f} "
            f"| {speedup:.1f}× | {first['total_s']:.2f} | {second['total_s']:.2f} "
            f"| {first['total_s'] / max(second['total_s'], 1e-9):.1f}× "
            f"| {'yes' if second['hit'] else 'no'} / {'yes' if second['export_hit'] else 'no'} "
            f"| {'yes' if first['program'] == second['program'] else 'no'} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
