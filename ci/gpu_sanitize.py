"""Small models on the CUDA backend, for `compute-sanitizer` (`ci/gpu_tests.sh` runs this
under `--tool memcheck` and `--tool racecheck` when SANITIZE_TIMEOUT is set): a two-layer
llama's prefill and decode step (f32 and bf16), with cuBLASLt and with every product a
generated kernel, each run twice (recorded, then replayed) and compared with eager.

    compute-sanitizer --tool racecheck python3 ci/gpu_sanitize.py

`python3 ci/gpu_sanitize.py --emulate` runs the same on the host emulator (a dry run
for machines without a GPU).
"""

from __future__ import annotations

import os
import sys

import ember
import torch
from ember.models import Llama, LlamaConfig, LlamaDecodeStep, llama_cache

EMULATE = "--emulate" in sys.argv
DEVICE = "cpu" if EMULATE else "cuda"
OPTIONS = {"backend": "cuda-emu"} if EMULATE else {}
SMALL = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, max_seq=64)


def cases(dtype: torch.dtype):
    torch.manual_seed(0)
    model = Llama(SMALL).eval().to(DEVICE, dtype)
    tokens = torch.randint(0, SMALL.vocab, (1, 40), device=DEVICE)
    yield "prefill", model, [tokens]
    step = LlamaDecodeStep(model).eval()
    cache = [c.to(DEVICE, dtype) for c in llama_cache(SMALL, 1, 40)]
    token = torch.randint(0, SMALL.vocab, (1, 1), device=DEVICE)
    yield "decode", step, [token, *cache]


def close(got, want, dtype: torch.dtype) -> bool:
    if isinstance(want, torch.Tensor):
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
        return torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    return all(close(g, w, dtype) for g, w in zip(got, want, strict=True))


def main() -> int:
    failures = 0
    for products in ("", "cuda.warp_dot"):
        os.environ["EMBER_CUDA_PRODUCTS"] = products
        for dtype in (torch.float32, torch.bfloat16):
            for name, model, args in cases(dtype):
                compiled = ember.compile(model, *args, search_iterations=0, cache=False, **OPTIONS)
                with torch.no_grad():
                    want = model(*args)
                    for call in range(2):
                        ok = close(compiled(*args), want, dtype)
                        failures += not ok
                        what = f"{name} {dtype} products={products or 'cublaslt'} call {call}"
                        print(f"{what}: {'ok' if ok else 'MISMATCH'}", flush=True)
    if not EMULATE:
        torch.cuda.synchronize()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
