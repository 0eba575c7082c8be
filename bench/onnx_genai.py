"""A Llama as ONNX Runtime's own LLM builder writes it (``onnxruntime-genai``:
GroupQueryAttention with run-time cache lengths, SkipSimplifiedLayerNormalization, and in
int4 MatMulNBits): median ms per call of Ember (``compile_onnx``, 2 threads) and ONNX
Runtime (CPU provider, 2 intra-op threads) in the same process, on the same inputs, plus
the largest difference of their logits. The model has random weights (the sizes of
``bench.onnx_decoder``); the builder runs once per precision into a temporary folder.

    pip install --no-deps onnxruntime-genai     # the builder (not a test dependency)
    python3 -m bench.onnx_genai [--precisions fp32,int4] [--past 128,512] [--prefill 32]

In int4, ONNX Runtime's CPU builder sets ``accuracy_level=4`` (activations rounded to int8
inside its products), so its logits differ from the exactly dequantized product Ember
computes by about 1 % of their scale; ``--exact`` sets level 0 in the file, where both agree
to float rounding.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import ember
import numpy as np
import onnx
import onnxruntime as ort
import transformers

from bench.onnx_decoder import HEAD_DIM, KV_HEADS, VOCAB, paired_medians_ms, random_llama


def save_random_llama(folder: Path) -> None:
    """A random Llama and a word-level tokenizer (the builder writes tokenizer files)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    random_llama(max_position_embeddings=2048).save_pretrained(folder)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="w0", bos_token="w1", eos_token="w2"
    )
    tokenizer.save_pretrained(folder)


def build(source: Path, precision: str, out: Path, exact: bool) -> Path:
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder"]
    cmd += ["-i", str(source), "-o", str(out), "-p", precision, "-e", "cpu"]
    cmd += ["-c", str(out / "cache")]
    subprocess.run(cmd, check=True, capture_output=True)
    path = out / "model.onnx"
    if exact:
        model = onnx.load(str(path), load_external_data=False)
        for node in model.graph.node:
            for attr in node.attribute:
                if attr.name == "accuracy_level":
                    attr.i = 0
        path = out / "model_exact.onnx"
        onnx.save(model, str(path))
    return path


def inputs(new: int, past: int, names: list[str]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(past * 131 + new)
    feeds = {
        "input_ids": rng.integers(0, VOCAB, (1, new)).astype(np.int64),
        "attention_mask": np.ones((1, past + new), np.int64),
    }
    for name in names:
        if name.startswith("past_key_values"):
            feeds[name] = rng.standard_normal((1, KV_HEADS, past, HEAD_DIM)).astype(np.float32)
    return feeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", default="fp32,int4")
    parser.add_argument("--past", default="128,512", help="past lengths of one-token steps")
    parser.add_argument("--prefill", type=int, default=32, help="new tokens of a prefill")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--exact", action="store_true", help="int4 at accuracy_level 0")
    a = parser.parse_args()
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        sys.exit("needs the builder: pip install --no-deps onnxruntime-genai")
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "hf"
        save_random_llama(source)
        print("| model | step | Ember ms | ORT ms | Ember / ORT | max logit diff |")
        print("|---|---|---:|---:|---:|---:|")
        for precision in a.precisions.split(","):
            path = build(source, precision, Path(tmp) / precision, a.exact)
            options = ort.SessionOptions()
            options.intra_op_num_threads = 2
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            compiled = ember.compile_onnx(str(path), num_threads=2)
            names = [i.name for i in session.get_inputs()]
            cases = [(1, int(p)) for p in a.past.split(",")] + [(a.prefill, 0)]
            for new, past in cases:
                feeds = inputs(new, past, names)
                ours, theirs = paired_medians_ms(
                    [lambda f=feeds, c=compiled: c(**f), lambda f=feeds, s=session: s.run(None, f)],
                    a.calls,
                )
                diff = float(np.abs(compiled(**feeds)[0] - session.run(None, feeds)[0]).max())
                label = f"decode, past {past}" if new == 1 else f"prefill {new} tokens"
                print(
                    f"| {precision} | {label} | {ours:.3f} | {theirs:.3f} | "
                    f"{ours / theirs:.2f}× | {diff:.1e} |"
                )


if __name__ == "__main__":
    main()
