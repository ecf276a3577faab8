"""GPU tests (marked `gpu`) skip with a stated reason where no CUDA GPU and torch are present."""
from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=1)
def gpu_missing_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed (GPU tests use it for inputs and the float64 reference)"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    return None


def tuner_missing_reason() -> str | None:
    """Why a real tune cannot run here (it also needs pycuda), or None."""
    import importlib.util  # noqa: PLC0415

    for mod in ("torch", "pycuda"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed"
    import torch  # noqa: PLC0415

    return None if torch.cuda.is_available() else "no CUDA GPU visible to torch"


def needs_gpu_tuner() -> list:
    """pytestmark of the tests that run a real tune on the GPU."""
    reason = tuner_missing_reason()
    return [pytest.mark.gpu, pytest.mark.skipif(reason is not None, reason=f"needs a GPU: {reason}")]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = gpu_missing_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
