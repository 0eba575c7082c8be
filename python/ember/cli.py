"""The ``ember`` command line: ``ember demo``, ``ember run``, ``ember bench`` (ONNX models)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch


def _median_ms(fn, args, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


DEMO_MODELS = ("llama", "qwen", "gpt2", "bert", "mixtral", "resnet", "mobilenet")


def _demo_model(name: str, seq: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], str]:
    """A built-in model, its inputs and a one-line description."""
    from ember.models import Llama, LlamaConfig, MobileNet, ResNet

    if name in ("qwen", "gpt2", "bert", "mixtral"):
        from ember import hf_models

        hf = hf_models.build(name)
        inputs = hf_models.forward_inputs(2, seq)
        what = f"{hf_models.describe(name, hf)}, 2 sequences of {seq} tokens (one padded)"
        return hf_models.MainOutput(hf).eval(), inputs, what
    if name == "llama":
        cfg = LlamaConfig()
        model = Llama(cfg).eval()
        params = sum(p.numel() for p in model.parameters()) / 1e6
        what = (
            f"llama-style decoder, {cfg.layers} layers, dim {cfg.dim}, {params:.1f}M "
            f"parameters, prompt of {seq} tokens"
        )
        return model, (torch.randint(0, cfg.vocab, (1, seq)),), what
    model = (ResNet() if name == "resnet" else MobileNet()).eval()
    params = sum(p.numel() for p in model.parameters()) / 1e6
    what = f"{name} CNN, {params:.2f}M parameters, 4 images of 3x64x64"
    return model, (torch.randn(4, 3, 64, 64),), what


def demo(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ember demo", description=demo.__doc__)
    parser.add_argument(
        "--model",
        choices=DEMO_MODELS,
        default="llama",
        help="llama: Ember's built-in llama-style decoder; qwen, gpt2, bert: transformers "
        "models of small random configs (needs transformers); resnet, mobilenet: CNNs",
    )
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's)")
    args = parser.parse_args(argv)

    import ember

    torch.manual_seed(0)
    try:
        model, inputs, what = _demo_model(args.model, args.seq)
    except ImportError as e:
        print(f"ember demo --model {args.model}: {e}", file=sys.stderr)
        return 2
    print(
        f"Ember {ember.__version__} demo: {what}, "
        f"{args.threads or torch.get_num_threads()} thread(s)"
    )
    options = {"num_threads": args.threads} if args.threads else {}
    compiled = torch.compile(model, backend="ember", options=options)
    with torch.no_grad():
        start = time.perf_counter()
        out = compiled(*inputs)
        compile_s = time.perf_counter() - start
        ref = model(*inputs)
        err = (out - ref).abs().max().item()
        # Interleave the two so that machine noise hits both alike.
        eager_ms, ember_ms = [], []
        for _ in range(3):
            eager_ms.append(_median_ms(model, inputs, args.repeats))
            ember_ms.append(_median_ms(compiled, inputs, args.repeats))
    eager, fast = statistics.median(eager_ms), statistics.median(ember_ms)
    report = ember.last_report()
    print(f"compile time:          {compile_s:.2f} s")
    if report is not None:
        chosen = (
            report.candidates[report.chosen].description if report.chosen is not None else "none"
        )
        source = " (from the compile cache)" if report.cache_hit else ""
        print(
            f"optimizer:             {report.egraph_nodes} e-nodes, "
            f"{len(report.candidates)} candidates measured and verified{source}; "
            f"chose: {chosen}"
        )
    print(f"max abs error vs eager: {err:.2e}")
    print(f"eager latency (median): {eager:.2f} ms")
    print(f"ember latency (median): {fast:.2f} ms")
    print(f"speed-up:               {eager / fast:.2f}x")
    if not err <= 1e-4:
        print("ERROR: Ember's output differs from eager PyTorch", file=sys.stderr)
        return 1
    return 0


demo.__doc__ = (
    f"Compile a built-in model ({', '.join(DEMO_MODELS)}) and compare it with eager PyTorch."
)


def _onnx_inputs(path: str, given: list[str], dims: list[str], seed: int) -> dict[str, Any]:
    """Inputs for an ONNX model: ``name=file.npy`` arrays, random ones for the rest (dynamic
    dims take ``--dim NAME=SIZE`` values, default 2)."""
    import numpy as np
    import onnx

    sizes = {}
    for spec in dims:
        name, _, value = spec.partition("=")
        sizes[name] = int(value)
    feeds: dict[str, Any] = {}
    for spec in given:
        name, sep, file = spec.partition("=")
        if not sep:
            raise SystemExit(f"--input expects NAME=FILE.npy, got {spec!r}")
        feeds[name] = np.load(file, allow_pickle=False)
    graph = onnx.load(path, load_external_data=False).graph
    weights = {t.name for t in graph.initializer}
    rng = np.random.default_rng(seed)
    for vi in graph.input:
        if vi.name in weights or vi.name in feeds:
            continue
        t = vi.type.tensor_type
        shape = [
            d.dim_value if d.HasField("dim_value") else sizes.get(d.dim_param, 2)
            for d in t.shape.dim
        ]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        if dtype.kind == "f":
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[vi.name] = rng.integers(0, 2, size=shape).astype(dtype)
        else:
            # Integer inputs are usually indices (token ids): keep them small and valid.
            feeds[vi.name] = rng.integers(0, 2, size=shape).astype(dtype)
    return feeds


def _onnx_parser(cmd: str, doc: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"ember {cmd}", description=doc)
    parser.add_argument("model", help="path of the .onnx file")
    parser.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy")
    parser.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def run(argv: list[str]) -> int:
    args = _onnx_parser("run", run.__doc__ or "").parse_args(argv)
    import numpy as np

    import ember

    feeds = _onnx_inputs(args.model, args.input, args.dim, args.seed)
    options = {"num_threads": args.threads} if args.threads else {}
    start = time.perf_counter()
    runner = ember.compile_onnx(args.model, **options)
    compile_s = time.perf_counter() - start
    outs = runner(**feeds)
    ms = _median_ms(lambda: runner(**feeds), (), args.repeats)
    print(f"compile time: {compile_s:.2f} s")
    for name, out in zip(runner.output_names, outs, strict=True):
        checksum = float(np.asarray(out, dtype=np.float64).sum())
        print(f"output {name}: shape {list(out.shape)} {out.dtype} checksum {checksum:.6g}")
    print(f"latency (median of {args.repeats}): {ms:.3f} ms")
    return 0


def bench(argv: list[str]) -> int:
    args = _onnx_parser("bench", bench.__doc__ or "").parse_args(argv)
    import numpy as np
    import onnxruntime as ort

    import ember

    feeds = _onnx_inputs(args.model, args.input, args.dim, args.seed)
    threads = args.threads or torch.get_num_threads()
    runner = ember.compile_onnx(args.model, num_threads=threads)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(args.model, opts, providers=["CPUExecutionProvider"])
    want = sess.run(None, feeds)
    got = runner(**feeds)
    err = max(
        (
            float(np.max(np.abs(g.astype(np.float64) - w)))
            for g, w in zip(got, want, strict=True)
            if g.size
        ),
        default=0.0,
    )
    ember_ms, ort_ms = [], []
    for _ in range(3):  # interleaved, so that machine noise hits both alike
        ember_ms.append(_median_ms(lambda: runner(**feeds), (), args.repeats))
        ort_ms.append(_median_ms(lambda: sess.run(None, feeds), (), args.repeats))
    fast, ref = statistics.median(ember_ms), statistics.median(ort_ms)
    print(f"model: {args.model} ({threads} thread(s))")
    print(f"max abs difference vs ONNX Runtime: {err:.2e}")
    print(f"onnxruntime latency (median): {ref:.3f} ms")
    print(f"ember latency (median):       {fast:.3f} ms")
    print(f"ratio (onnxruntime / ember):  {ref / fast:.2f}x")
    return 0


run.__doc__ = "Compile an ONNX model and run it once on given or random inputs."
bench.__doc__ = "Compare Ember with ONNX Runtime (CPU) on an ONNX model: medians and ratio."


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": demo, "run": run, "bench": bench}
    if not argv or argv[0] not in commands:
        usage = "usage: ember {demo,run,bench} [options]\n" + "".join(
            f"  {name:6}{fn.__doc__}\n" for name, fn in commands.items()
        )
        print(usage, file=sys.stderr, end="")
        return 2
    return commands[argv[0]](argv[1:])
