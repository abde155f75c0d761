"""Shared test fixtures: GPU marker handling and the shared media folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

MEDIA = Path(os.environ.get("LOOM_MEDIA") or Path(__file__).resolve().parents[1].parent / "shared" / "media")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def media_dir() -> Path:
    if not MEDIA.is_dir():
        pytest.skip(f"shared test media not found at {MEDIA} (a fresh clone has no ../shared)")
    return MEDIA


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny CPU models run fastest single-threaded, and results do not depend on core count."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_dynamo(request):
    """Each GPU test compiles its own models; Dynamo counts recompiles per function across the process,
    so a long GPU run would hit its limit (8) on the shared ops (say `sink_similarity` at another
    batch) where one engine process never does. Forget the compiled frames after each GPU test."""
    yield
    if "gpu" in request.keywords and "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
