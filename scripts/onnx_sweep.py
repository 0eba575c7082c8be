"""Exports small random Hugging Face models (nothing downloaded) to ONNX and compares Ember
with ONNX Runtime on each: the quickest way to find what real exporters write that Ember
does not read.

    python3 scripts/onnx_sweep.py                     # TorchScript exporter, static shapes
    python3 scripts/onnx_sweep.py --dynamic           # dynamic batch (and length for text)
    python3 scripts/onnx_sweep.py --exporter dynamo --dynamic --models bert,llama

Each line: OK (max error within 1e-3 of the output's scale, at both sizes when dynamic),
BAD (a wrong answer), FAIL (Ember raised) or SKIP (torch could not export it or ONNX
Runtime could not run it).
"""

from __future__ import annotations

import argparse
import io
import time
import warnings
from collections.abc import Callable
from typing import Any

import ember
import numpy as np
import onnxruntime as ort
import torch
import transformers as T

SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 300,
}
VIT = {**SMALL, "image_size": 32, "patch_size": 8}
VIT.pop("vocab_size")
TEXT_INPUTS = ("input_ids", "attention_mask")
Case = tuple[torch.nn.Module, tuple[torch.Tensor, ...], list[str]]


def text(config: Any, model: Any, **overrides: Any) -> Case:
    m = model(config(**{**SMALL, **overrides})).eval()
    ids = torch.randint(0, 300, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    return m, (ids, mask), list(TEXT_INPUTS)


def vision(config: Any, model: Any, **kw: Any) -> Case:
    return model(config(**kw)).eval(), (torch.randn(2, 3, 32, 32),), ["pixel_values"]


def t5() -> Case:
    config = T.T5Config(vocab_size=300, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
    ids = torch.randint(0, 300, (2, 7))
    return (
        T.T5EncoderModel(config).eval(),
        (ids, torch.ones(2, 7, dtype=torch.long)),
        list(TEXT_INPUTS),
    )


def whisper() -> Case:
    config = T.WhisperConfig(
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        num_mel_bins=16,
        max_source_positions=20,
        vocab_size=300,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    return (
        T.WhisperModel(config).get_encoder().eval(),
        (torch.randn(1, 16, 40),),
        ["input_features"],
    )


def wav2vec2() -> Case:
    config = T.Wav2Vec2Config(
        **{k: v for k, v in SMALL.items() if k != "vocab_size"},
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
    )
    return T.Wav2Vec2Model(config).eval(), (torch.randn(1, 800),), ["input_values"]


STAGES = {"hidden_sizes": [16, 32, 48, 64], "depths": [1, 1, 1, 1]}
CASES: dict[str, Callable[[], Case]] = {
    "bert": lambda: text(T.BertConfig, T.BertModel),
    "roberta": lambda: text(T.RobertaConfig, T.RobertaModel, pad_token_id=1),
    "distilbert": lambda: text(
        T.DistilBertConfig, T.DistilBertModel, dim=64, n_layers=2, n_heads=4, hidden_dim=128
    ),
    "albert": lambda: text(T.AlbertConfig, T.AlbertModel, embedding_size=32),
    "electra": lambda: text(T.ElectraConfig, T.ElectraModel, embedding_size=32),
    "deberta-v2": lambda: text(T.DebertaV2Config, T.DebertaV2Model),
    "gpt2": lambda: text(T.GPT2Config, T.GPT2Model, n_embd=64, n_layer=2, n_head=4),
    "gpt-neo": lambda: text(
        T.GPTNeoConfig,
        T.GPTNeoModel,
        attention_types=[[["global", "local"], 1]],
        num_layers=2,
        window_size=4,
    ),
    "opt": lambda: text(T.OPTConfig, T.OPTModel, ffn_dim=128, word_embed_proj_dim=64),
    "bloom": lambda: text(T.BloomConfig, T.BloomModel, n_layer=2, n_head=4),
    "llama": lambda: text(T.LlamaConfig, T.LlamaModel, num_key_value_heads=2),
    "mistral": lambda: text(T.MistralConfig, T.MistralModel, num_key_value_heads=2),
    "qwen2": lambda: text(T.Qwen2Config, T.Qwen2Model, num_key_value_heads=2),
    "phi": lambda: text(T.PhiConfig, T.PhiModel),
    "falcon": lambda: text(T.FalconConfig, T.FalconModel),
    "t5-encoder": t5,
    "vit": lambda: vision(T.ViTConfig, T.ViTModel, **VIT),
    "deit": lambda: vision(T.DeiTConfig, T.DeiTModel, **VIT),
    "clip-vision": lambda: vision(T.CLIPVisionConfig, T.CLIPVisionModel, **VIT),
    "convnext": lambda: vision(T.ConvNextConfig, T.ConvNextModel, **STAGES),
    "resnet": lambda: vision(T.ResNetConfig, T.ResNetModel, embedding_size=16, **STAGES),
    "swin": lambda: vision(
        T.SwinConfig,
        T.SwinModel,
        image_size=32,
        patch_size=2,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 4],
        window_size=4,
    ),
    "mobilevit": lambda: vision(
        T.MobileViTConfig,
        T.MobileViTModel,
        image_size=32,
        hidden_sizes=[16, 24, 32],
        neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32],
    ),
    "segformer": lambda: vision(
        T.SegformerConfig, T.SegformerModel, num_attention_heads=[1, 2, 2, 4], **STAGES
    ),
    "whisper-encoder": whisper,
    "wav2vec2": wav2vec2,
}


class FirstOutput(torch.nn.Module):
    """The model's first output (its last hidden state), inputs by name."""

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = self.model(**dict(zip(self.names, args, strict=True)))
        return out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state


def dynamic_dims(name: str) -> list[int]:
    """Which dims of an input are dynamic: batch, and length for token and audio inputs."""
    return [0, 1] if name in (*TEXT_INPUTS, "input_values") else [0]


def export(model: torch.nn.Module, args: tuple, names: list[str], how: str, dyn: bool) -> bytes:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "ts":
            axes = {n: {d: f"{n}_{d}" for d in dynamic_dims(n)} for n in names} if dyn else None
            buffer = io.BytesIO()
            torch.onnx.export(
                model,
                args,
                buffer,
                dynamo=False,
                opset_version=17,
                input_names=names,
                dynamic_axes=axes,
            )
            return buffer.getvalue()
        shapes = None
        if dyn:
            batch = torch.export.Dim("batch", min=2, max=64)
            length = torch.export.Dim("length", min=2, max=4096)
            spec = [
                {0: batch, 1: length} if len(dynamic_dims(n)) > 1 else {0: batch} for n in names
            ]
            shapes = (tuple(spec),)
        program = torch.onnx.export(
            model, args, dynamo=True, input_names=names, dynamic_shapes=shapes
        )
        return program.model_proto.SerializeToString()


def second_size(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Other sizes of the dynamic dims: one more batch row, a shorter length."""
    out = {}
    for k, v in feeds.items():
        v = np.concatenate([v, v[:1]], 0)
        if len(dynamic_dims(k)) > 1:
            v = v[:, : max(2, v.shape[1] * 3 // 4)]
        out[k] = np.ascontiguousarray(v)
    return out


def lively(model: torch.nn.Module) -> torch.nn.Module:
    """Unit norm scales and He-initialized weights: Hugging Face's init scales norms by
    ~0.02, so some random models (MobileViT) output all zeros, which compare equal to
    anything."""
    for m in model.modules():
        if isinstance(m, (torch.nn.BatchNorm2d, torch.nn.LayerNorm, torch.nn.GroupNorm)):
            if m.weight is not None:
                torch.nn.init.ones_(m.weight)
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
            torch.nn.init.kaiming_normal_(m.weight)
    return model


def check(name: str, how: str, dyn: bool, backend: str = "cpu") -> str:
    model, args, names = CASES[name]()
    lively(model)
    wrapped = FirstOutput(model, names).eval()
    try:
        data = export(wrapped, args, names, how, dyn)
        session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        given = {n: a.numpy() for n, a in zip(names, args, strict=True)}
        feeds = [{i.name: given[i.name] for i in session.get_inputs()}]
        if dyn:
            feeds.append(second_size(feeds[0]))
        wants = [session.run(None, f)[0] for f in feeds]
    except Exception as e:  # noqa: BLE001 - an export problem, not Ember's
        return f"SKIP {type(e).__name__}: {str(e).splitlines()[0][:150]}"
    try:
        compiled = ember.compile_onnx(data, backend=backend)
        errors = []
        for f, want in zip(feeds, wants, strict=True):
            got = compiled(**f)[0]
            errors.append(float(np.abs(got - want).max()) / max(1.0, float(np.abs(want).max())))
    except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
        return f"FAIL {type(e).__name__}: {str(e)[:300]}"
    status = "OK " if max(errors) <= 1e-3 else "BAD"
    return f"{status} relative error {max(errors):.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exporter", choices=["ts", "dynamo"], default="ts")
    parser.add_argument("--dynamic", action="store_true", help="dynamic batch/length axes")
    parser.add_argument(
        "--backend",
        default="cpu",
        help="cpu, or cuda-emu: the CUDA backend's generated kernels run on the host",
    )
    parser.add_argument("--models", help="comma-separated subset of: " + ", ".join(CASES))
    a = parser.parse_args()
    torch.manual_seed(0)
    T.logging.set_verbosity_error()
    for name in a.models.split(",") if a.models else CASES:
        start = time.time()
        result = check(name, a.exporter, a.dynamic, a.backend)
        print(f"{name:16s} {result} ({time.time() - start:.1f} s)")


if __name__ == "__main__":
    main()
