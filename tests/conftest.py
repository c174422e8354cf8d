"""Shared fixtures: tiny model directories (built once per cache) and the CUDA skip for `gpu`.

Model directories come from `ringserve.gpu.testing` and are cached under RINGSERVE_HOME
(scripts/test points it inside the project; a bare pytest run uses the same place).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("RINGSERVE_HOME", str(_ROOT / ".cache" / "ringserve"))
os.environ.setdefault("HF_HOME", str(_ROOT / ".cache" / "hf"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # get_closest_marker, not `"gpu" in item.keywords`: keywords also hold directory names.
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    """A 2-layer Llama (hidden 64, GQA 4/2 heads, vocab 8000)."""
    from ringserve.gpu.testing import tiny_model

    return tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_mistral_dir() -> Path:
    """A 2-layer Mistral (no sliding window)."""
    from ringserve.gpu.testing import tiny_model

    return tiny_model("mistral")


@pytest.fixture(scope="session")
def tiny_qwen2_dir() -> Path:
    """A 2-layer Qwen2 (qkv bias, tied embeddings)."""
    from ringserve.gpu.testing import tiny_model

    return tiny_model("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir() -> Path:
    """A 2-layer Qwen3 (q/k RMSNorm, head_dim 32 != hidden / heads)."""
    from ringserve.gpu.testing import tiny_model

    return tiny_model("qwen3")


@pytest.fixture(scope="session")
def tiny_gemma2_dir() -> Path:
    """A 2-layer Gemma 2 (sliding window 8, attention and final soft-caps)."""
    from ringserve.gpu.testing import tiny_model

    return tiny_model("gemma2")


@pytest.fixture(scope="session")
def tiny_gemma3_dir() -> Path:
    """A 2-layer Gemma 3 text model (q/k norms, local rope table, sliding window 8)."""
    from ringserve.gpu.testing import tiny_model

    return tiny_model("gemma3")


@pytest.fixture(scope="session")
def tiny_phi3_dir() -> Path:
    """A 2-layer Phi-3 (fused qkv / gate_up checkpoint tensors, sliding window 8)."""
    from ringserve.gpu.testing import tiny_model

    return tiny_model("phi3")


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The demo model (Llama, hidden 256, 4 layers, vocab 8000)."""
    from ringserve.gpu.testing import demo_model_path

    return demo_model_path()


@pytest.fixture(params=["llama", "mistral", "qwen2", "qwen3"])
def tiny_model_dir(request: pytest.FixtureRequest) -> Iterator[Path]:
    """Each tiny family in turn."""
    from ringserve.gpu.testing import tiny_model

    yield tiny_model(request.param)
