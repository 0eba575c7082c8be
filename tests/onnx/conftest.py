"""The ONNX tests' fixtures."""

from collections.abc import Iterator

import onnx_util
import pytest


@pytest.fixture(params=onnx_util.CHECK_BACKENDS)
def check_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a test whose models go through `onnx_util.check` on each backend: `check`
    compiles for it."""
    onnx_util.check_backend = request.param
    try:
        yield request.param
    finally:
        onnx_util.check_backend = "cpu"
