"""A Llama step with a KV cache as ONNX deployments export it (Optimum's
``decoder_with_past``: past keys/values as inputs, logits and updated caches as outputs,
batch / new tokens / past length dynamic), written by torch's TorchScript exporter: median
ms per call of Ember (``compile_onnx``, 2 threads) and ONNX Runtime (CPU provider, 2
intra-op threads) in the same process, on the same inputs, plus the largest difference of
their logits.

    python3 -m bench.onnx_decoder [--past 128,512] [--prefill 32] [--calls 200]
"""

from __future__ import annotations

import argparse
import io
import time
import warnings
from collections.abc import Callable

import ember
import numpy as np
import onnxruntime as ort
import torch
import transformers
from ember.hf_models import DecoderWithPast

LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB = 4, 256, 8, 4, 1024
HEAD_DIM = HIDDEN // HEADS


NAMES = ["input_ids", "attention_mask", "position_ids"] + [
    f"past_{i}_{kv}" for i in range(LAYERS) for kv in ("key", "value")
]


def inputs(new: int, past: int) -> dict[str, np.ndarray]:
    g = torch.Generator().manual_seed(past * 131 + new)
    values = [
        torch.randint(0, VOCAB, (1, new), generator=g),
        torch.ones(1, past + new, dtype=torch.long),
        torch.arange(past, past + new).reshape(1, new),
        *[torch.randn(1, KV_HEADS, past, HEAD_DIM, generator=g) for _ in range(2 * LAYERS)],
    ]
    return {n: v.numpy() for n, v in zip(NAMES, values, strict=True)}


def random_llama(**config: object) -> transformers.LlamaForCausalLM:
    """The benchmarks' random Llama (seeded; `config` adds to the sizes above)."""
    torch.manual_seed(0)
    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=688,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
    )
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes, **config)).eval()


def export() -> bytes:
    step = DecoderWithPast(random_llama(), LAYERS).eval()
    axes = {
        "input_ids": {0: "batch", 1: "new"},
        "attention_mask": {0: "batch", 1: "total"},
        "position_ids": {0: "batch", 1: "new"},
    } | {n: {0: "batch", 2: "past"} for n in NAMES[3:]}
    example = tuple(torch.from_numpy(v) for v in inputs(3, 4).values())
    buffer = io.BytesIO()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            step,
            example,
            buffer,
            dynamo=False,
            opset_version=17,
            input_names=NAMES,
            dynamic_axes=axes,
        )
    return buffer.getvalue()


def paired_medians_ms(
    runs: list[Callable[[], object]], calls: int, rounds: int = 10
) -> list[float]:
    """Median ms per call of each of `runs`, timed in alternating rounds of `calls / rounds`
    calls each, so that a slow spell of a noisy machine falls on all of them alike (timed
    one after the other, the same two runs measured ratios 1.2× apart between sessions)."""
    for run in runs:
        for _ in range(5):
            run()
    times: list[list[float]] = [[] for _ in runs]
    per_round = max(1, calls // rounds)
    for _ in range(rounds):
        for run, own in zip(runs, times, strict=True):
            for _ in range(per_round):
                start = time.perf_counter()
                run()
                own.append(time.perf_counter() - start)
    return [float(np.median(t)) * 1e3 for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--past", default="128,512", help="past lengths of one-token steps")
    parser.add_argument("--prefill", type=int, default=32, help="new tokens of a prefill")
    parser.add_argument("--calls", type=int, default=200)
    a = parser.parse_args()
    torch.set_num_threads(2)
    data = export()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    compiled = ember.compile_onnx(data, num_threads=2)
    cases = [(1, int(p)) for p in a.past.split(",")] + [(a.prefill, 0)]
    print("| step | Ember ms | ORT ms | Ember / ORT | max logit diff |")
    print("|---|---:|---:|---:|---:|")
    for new, past in cases:
        feeds = inputs(new, past)
        ours, theirs = paired_medians_ms(
            [lambda f=feeds: compiled(**f), lambda f=feeds: session.run(None, f)], a.calls
        )
        diff = float(np.abs(compiled(**feeds)[0] - session.run(None, feeds)[0]).max())
        label = f"decode, past {past}" if new == 1 else f"prefill {new} tokens"
        print(f"| {label} | {ours:.3f} | {theirs:.3f} | {ours / theirs:.2f}× | {diff:.1e} |")


if __name__ == "__main__":
    main()
