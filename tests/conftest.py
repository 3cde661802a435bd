"""Shared fixtures: the default model loaded once, and engines built from it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def smollm2():
    """Config and float32 weights of the bundled SmolLM2-135M-Instruct."""
    from radixmesh.services.worker.model_source import load_model

    return load_model(None, progress=False)
