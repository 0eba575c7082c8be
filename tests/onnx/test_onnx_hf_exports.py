"""Hugging Face models (small random configs, nothing downloaded) exported by torch's
TorchScript ONNX exporter, compiled by Ember and compared with ONNX Runtime. These exports
compute static sizes by routes plain shape folding does not follow (Swin's window padding,
MobileViT's patch sizes through float `ceil`)."""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from typing import Any

import ember
import numpy as np
import onnx
import pytest
import torch
from ember.hf_models import DecoderWithPast
from onnx_util import ort_run

transformers = pytest.importorskip("transformers")


class FirstOutput(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).last_hidden_state


def swin() -> torch.nn.Module:
    config = transformers.SwinConfig(
        image_size=32, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4
    )
    return transformers.SwinModel(config)


def mobilevit() -> torch.nn.Module:
    config = transformers.MobileViTConfig(
        image_size=32, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32]
    )
    return transformers.MobileViTModel(config)


def lively(model: torch.nn.Module) -> torch.nn.Module:
    """Hugging Face's initialization scales norms by ~0.02, so a random MobileViT's output
    decays to zeros; unit norms and He-initialized weights keep activations of order one,
    so the comparison means something."""
    for m in model.modules():
        if isinstance(m, (torch.nn.BatchNorm2d, torch.nn.LayerNorm, torch.nn.GroupNorm)):
            torch.nn.init.ones_(m.weight)
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
            torch.nn.init.kaiming_normal_(m.weight)
    return model


@pytest.mark.parametrize("build", [swin, mobilevit], ids=["swin", "mobilevit"])
def test_vision_model_exported_by_torchscript_matches_onnx_runtime(
    build: Callable[[], Any],
) -> None:
    torch.manual_seed(0)
    model = FirstOutput(lively(build()).eval()).eval()
    x = torch.randn(2, 3, 32, 32)
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (x,), buffer, dynamo=False, opset_version=17, input_names=["pixel_values"]
        )
    written = onnx.load_from_string(buffer.getvalue())
    feeds = {"pixel_values": x.numpy()}
    want = ort_run(written, feeds)[0]
    got = ember.compile_onnx(written)(**feeds)[0]
    assert got.shape == want.shape and np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


class TextOutput(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 300,
}


def bert() -> torch.nn.Module:
    return transformers.BertModel(transformers.BertConfig(**SMALL))


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4)
    return transformers.GPT2Model(config)


def llama() -> torch.nn.Module:
    return transformers.LlamaModel(transformers.LlamaConfig(**SMALL, num_key_value_heads=2))


@pytest.mark.parametrize("build", [bert, gpt2, llama], ids=["bert", "gpt2", "llama"])
def test_text_model_exported_with_dynamic_axes_serves_two_sizes(
    build: Callable[[], Any],
) -> None:
    """`dynamic_axes` exports spell `expand` as `Where(Equal(sizes, -1), …)` and reshapes
    with `-1`: with a symbolic batch and length these must still fold into IR dims."""
    torch.manual_seed(0)
    model = TextOutput(build().eval()).eval()
    ids = torch.randint(0, 300, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    buffer = io.BytesIO()
    names = ["input_ids", "attention_mask"]
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (ids, mask),
            buffer,
            dynamo=False,
            opset_version=17,
            input_names=names,
            dynamic_axes={n: {0: "batch", 1: "seq"} for n in names},
        )
    written = onnx.load_from_string(buffer.getvalue())
    compiled = ember.compile_onnx(written)
    for batch, seq in ((2, 7), (3, 5)):
        ids = np.random.default_rng(seq).integers(0, 300, (batch, seq))
        mask = np.ones((batch, seq), np.int64)
        mask[-1, seq - 2 :] = 0
        feeds = {"input_ids": ids, "attention_mask": mask}
        want = ort_run(written, feeds)[0]
        got = compiled(**feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_llama_step_with_a_kv_cache_exported_with_dynamic_axes():
    """Batch, new tokens and past length all dynamic: one compiled model serves a prefill
    continuation and a one-token decode step, logits and updated caches alike."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SMALL, num_key_value_heads=2)
    step = DecoderWithPast(transformers.LlamaForCausalLM(config).eval(), 2).eval()
    pasts = [f"past_{i}_{kv}" for i in range(2) for kv in ("key", "value")]
    names = ["input_ids", "attention_mask", "position_ids", *pasts]

    def inputs(batch: int, new: int, past: int) -> tuple[torch.Tensor, ...]:
        ids = torch.randint(0, 300, (batch, new))
        mask = torch.ones(batch, past + new, dtype=torch.long)
        positions = torch.arange(past, past + new).expand(batch, new).contiguous()
        return (ids, mask, positions, *[torch.randn(batch, 2, past, 16) for _ in pasts])

    axes = {
        "input_ids": {0: "batch", 1: "new"},
        "attention_mask": {0: "batch", 1: "total"},
        "position_ids": {0: "batch", 1: "new"},
    } | {p: {0: "batch", 2: "past"} for p in pasts}
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            step,
            inputs(2, 3, 4),
            buffer,
            dynamo=False,
            opset_version=17,
            input_names=names,
            dynamic_axes=axes,
        )
    written = onnx.load_from_string(buffer.getvalue())
    compiled = ember.compile_onnx(written)
    for batch, new, past in ((2, 3, 4), (1, 1, 9)):
        values = inputs(batch, new, past)
        feeds = {n: v.numpy() for n, v in zip(names, values, strict=True)}
        want = ort_run(written, feeds)
        got = compiled(**feeds)
        assert len(got) == 5
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
