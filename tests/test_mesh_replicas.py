"""2 tokenizers + 2 detokenizers + 2 engines as real processes on the real SmolLM2: every
request completes exactly once, and prefixes follow the engine that cached them."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest
from process_helpers import running_mesh

from radixmesh.launcher import Mesh


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> Iterator[Mesh]:
    log_dir = tmp_path_factory.mktemp("mesh-logs")
    with running_mesh(
        log_dir, dp_size=2, tokenizers=2, detokenizers=2, max_total_tokens=8192
    ) as m:
        for url in m.http_urls:  # each tokenizer must have heard both engines' heartbeats
            deadline = time.monotonic() + 10
            while len(httpx.get(url + "/server_info").json()["engines"]) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        yield m


def generate(url: str, text: str, max_new: int) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}
    r = httpx.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_every_request_completes_once(mesh):
    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as http:
            async def one(i: int) -> dict:
                url = mesh.http_urls[i % 2]
                body = {"text": f"Request {i} says", "stream": i % 3 == 0,
                        "sampling_params": {"max_new_tokens": 6 + i % 4, "ignore_eos": True}}
                r = await http.post(url + "/generate", json=body)
                assert r.status_code == 200, r.text
                if body["stream"]:
                    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                              if line.startswith("data: {")]
                    finals = [c for c in chunks if c["meta_info"]["finish_reason"]]
                    assert len(finals) == 1 and chunks[-1] is finals[0], r.text
                    return {"i": i, "n": finals[0]["meta_info"]["completion_tokens"]}
                return {"i": i, "n": r.json()["meta_info"]["completion_tokens"]}

            return await asyncio.gather(*(one(i) for i in range(16)))

    for result in asyncio.run(run()):
        assert result["n"] == 6 + result["i"] % 4
    engines = httpx.get(mesh.http_urls[0] + "/server_info").json()["engines"]
    assert len(engines) == 2


def test_shared_prefix_lands_on_the_engine_that_cached_it(mesh):
    prefixes = [f"Document {k}: " + " ".join(f"fact{k}-{j}" for j in range(150)) for k in range(4)]
    first = [generate(mesh.http_urls[0], p + " Question A?", 2) for p in prefixes]
    states = httpx.get(mesh.http_urls[0] + "/server_info").json()["internal_states"]
    # Unrelated prefixes were spread over both engines, so landing right is not luck.
    assert all(s["cached_tokens"] >= 300 for s in states), states
    for p, f in zip(prefixes, first, strict=True):
        # Through the other tokenizer replica: it learned the engine's cache from events.
        again = generate(mesh.http_urls[1], p + " Question B?", 2)
        assert again["meta_info"]["cached_tokens"] >= f["meta_info"]["prompt_tokens"] - 8
