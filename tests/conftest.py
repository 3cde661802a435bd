"""Shared fixtures: the default model and its tokenizer loaded once, a NATS server per test
module and a connection to it, an in-process engine per module (float32, and one that
prefills in chunks of 4), asyncio for anyio tests."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def smollm2():
    """Config and float32 weights of the bundled SmolLM2-135M-Instruct."""
    from radixmesh.engine.model.model_source import load_model

    return load_model(None, progress=False)


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    """A NATS server of this test module's own, on a free port."""
    from radixmesh.mesh.nats_server import EmbeddedNats

    with EmbeddedNats() as server:
        yield server.url


@pytest.fixture
async def nc(nats_url):
    """A NATS connection to this module's server (for anyio tests)."""
    import nats

    conn = await nats.connect(nats_url)
    yield conn
    await conn.close()


@pytest.fixture(scope="module")
def tokenizer():
    """The default model's tokenizer."""
    from radixmesh.core.tokenizer import Tokenizer

    return Tokenizer.from_path(None)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def engine():
    """The bundled model in float32, one per test module (its tests share its prefix cache)."""
    from radixmesh.api import Engine

    eng = Engine(dtype="float32", max_total_tokens=8192, show_progress=False, random_seed=0)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def chunked():
    """The same, prefilling 4 tokens a step, so every prompt spans several chunks."""
    from radixmesh.api import Engine

    eng = Engine(dtype="float32", max_total_tokens=2048, chunked_prefill_size=4,
                 show_progress=False, random_seed=0)
    yield eng
    eng.shutdown()
