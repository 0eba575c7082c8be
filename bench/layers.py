"""``python3 -m bench.layers``: where Ember and ONNX Runtime spend a model's time, step by
step, on the same thread count in the same process. Ember's steps come from
``ember.profile_cpu``, ORT's nodes from its own profiler (on the file ``torch.onnx.export``
writes); each is listed as µs per call by op and output shape, slowest first, after both
untimed medians. For finding the kernels that trail ORT's: the whole-model ratio in
``bench/RESULTS.md`` says how far behind, this says where.

The default is one thread: a kernel's own speed, and the least noise from the host (on a
shared two-core machine the second core's speed drifts by a quarter from minute to minute).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import defaultdict

import ember
import numpy as np
import torch

from bench.backends import _export_onnx
from bench.cases import CASES
from bench.cpu_decode import _medians


def _ort_rows(profile_path: str, skip_runs: int) -> list[tuple[str, str, float]]:
    """(op, output shape, µs per run) of every ORT node kind over the profiled runs after the
    first ``skip_runs`` (warm-up), slowest first."""
    with open(profile_path) as f:
        events = json.load(f)
    starts = sorted(e["ts"] for e in events if e.get("name") == "model_run")
    if len(starts) <= skip_runs:
        raise RuntimeError(f"ORT's profile holds {len(starts)} runs, fewer than expected")
    cutoff, runs = starts[skip_runs], len(starts) - skip_runs
    totals: dict[tuple[str, str], float] = defaultdict(float)
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        if e["ts"] < cutoff:
            continue
        args = e.get("args", {})
        shapes = [dims for out in args.get("output_type_shape", []) for dims in out.values()]
        shape = str(shapes[0]) if len(shapes) == 1 else str(shapes)
        totals[(args.get("op_name", "?"), shape)] += e["dur"]
    rows = [(op, shape, us / runs) for (op, shape), us in totals.items()]
    return sorted(rows, key=lambda r: -r[2])


def compare(name: str, threads: int, calls: int) -> str:
    import onnxruntime as ort

    torch.set_num_threads(threads)
    model, inputs = CASES[name].make()
    compiled = ember.compile(model, *inputs, num_threads=threads, quiet=True)
    with tempfile.TemporaryDirectory(prefix="ember-layers-") as tmp:
        path = os.path.join(tmp, "model.onnx")
        _export_onnx(model, inputs, path)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(tmp, "ort")
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        feed = {n: x.contiguous().numpy() for n, x in zip(names, inputs, strict=True)}

        def run_ember() -> object:
            return compiled(*inputs)

        def run_ort() -> object:
            return session.run(None, feed)

        with torch.no_grad():
            want = model(*inputs)
            want = want[0] if isinstance(want, tuple) else want
            got = run_ember()
            got = got[0] if isinstance(got, tuple) else got
        error = float((got - want).abs().max())
        ort_error = float(np.abs(run_ort()[0] - want.numpy()).max())
        # ORT's profile covers every run since the session started; the first ones (the
        # check above and a warm-up) are left out of its rows.
        for _ in range(10):
            run_ort()
            run_ember()
        # The profiled calls alternate, so that both profiles see the same host: this
        # machine's speed drifts by a quarter from minute to minute (docs/LESSONS.md).
        with ember.profile_cpu() as prof:
            for _ in range(calls):
                run_ember()
                run_ort()
        ort_rows = _ort_rows(session.end_profiling(), skip_runs=11)
        ember_us, ort_us = (ms * 1e3 for ms in _medians([run_ember, run_ort], calls))

    lines = [
        f"## {CASES[name].title}: {threads} thread(s), {calls} calls",
        "",
        f"Untimed medians: Ember {ember_us:.1f} µs, ORT {ort_us:.1f} µs "
        f"(Ember / ORT = {ember_us / ort_us:.3f}); max abs error vs eager: "
        f"Ember {error:.1e}, ORT {ort_error:.1e}",
        "",
        f"Ember's steps (profiled; sum {prof.total_s / calls * 1e6:.1f} µs per call):",
        "",
    ]
    for r in prof.rows:
        shape = "[" + ", ".join(map(str, r.shape)) + "]"
        lines.append(f"  {r.label:36s} {shape:>20s} {r.seconds / calls * 1e6:9.1f} µs")
    total = sum(us for _, _, us in ort_rows)
    lines += ["", f"ORT's nodes (profiled; sum {total:.1f} µs per call):", ""]
    for op, shape, us in ort_rows:
        lines.append(f"  {op:36s} {shape:>20s} {us:9.1f} µs")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.layers", description=__doc__)
    parser.add_argument(
        "--models",
        default="cnn",
        help=f"comma-separated cases (default cnn): {', '.join(CASES)}",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    for name in args.models.split(","):
        if name not in CASES:
            parser.error(f"unknown case {name!r}; choose from {', '.join(CASES)}")
        print(compare(name, args.threads, args.calls), flush=True)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
