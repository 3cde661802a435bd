"""Property-based fuzzing of the HTTP front door: a tokenizer replica (the real server, on a
real NATS, in front of a fake engine) gets arbitrary JSON, near-valid bodies with fields of
every wrong type, and bytes that are not JSON, on native /generate and the OpenAI routes.
Every answer is a 2xx or a 4xx with a JSON error naming the problem; never a 5xx, never a
hang; and the server still serves a plain request afterwards."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import nats
import pytest
from fake_engine import FakeEngine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixmesh.core.service_settings import TokenizerServiceConfig
from radixmesh.mesh.nats_server import EmbeddedNats
from radixmesh.services.tokenizer.server import TokenizerServer

ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions"]
BASE: dict[str, dict[str, Any]] = {
    "/generate": {"text": "Hi", "sampling_params": {"max_new_tokens": 4}},
    "/v1/completions": {"model": "m", "prompt": "Hi", "max_tokens": 4},
    "/v1/chat/completions": {"model": "m", "max_tokens": 4,
                             "messages": [{"role": "user", "content": "Hi"}]},
}
FIELDS = {  # fields each route reads, which the fuzzer fills with anything
    "/generate": ["text", "input_ids", "sampling_params", "stream", "rid", "return_logprob",
                  "logprob_start_len", "top_logprobs_num", "cache_salt", "priority",
                  "return_text_in_logprobs"],
    "/v1/completions": ["prompt", "max_tokens", "temperature", "top_p", "n", "stop", "stream",
                        "logprobs", "echo", "seed", "response_format", "stream_options",
                        "logit_bias", "min_tokens", "regex", "ebnf", "best_of"],
    "/v1/chat/completions": ["messages", "max_tokens", "max_completion_tokens", "temperature",
                             "n", "stop", "stream", "logprobs", "top_logprobs", "tools",
                             "tool_choice", "response_format", "seed", "presence_penalty"],
}
SAMPLING = ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
            "stop_token_ids", "ignore_eos", "n", "json_schema", "regex", "ebnf",
            "frequency_penalty", "repetition_penalty", "min_new_tokens", "seed"]

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """The tokenizer's base URL; it and its fake engine run on a loop of their own."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    with EmbeddedNats() as bus:
        async def up() -> tuple[TokenizerServer, Any, FakeEngine]:
            server = TokenizerServer(TokenizerServiceConfig(
                port=0, grpc_port=-1, nats_url=bus.url, engine_timeout=30,
                served_model_name="m"))
            await server.start()
            nc = await nats.connect(bus.url)
            engine = await FakeEngine(nc, f"fuzz-{os.urandom(3).hex()}",
                                      context_length=256).start()
            assert server.client is not None
            await server.client.wait_for_engines(1)
            return server, nc, engine

        server, nc, engine = asyncio.run_coroutine_threadsafe(up(), loop).result(60)
        yield f"http://127.0.0.1:{server.port}"

        async def down() -> None:
            await engine.stop()
            await nc.close()
            await server.stop()

        asyncio.run_coroutine_threadsafe(down(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)


def answered(url: str, route: str, content: bytes) -> httpx.Response:
    reply = httpx.post(url + route, content=content, timeout=30,
                       headers={"Content-Type": "application/json"})
    assert reply.status_code < 500, (route, content[:300], reply.status_code, reply.text[:300])
    if reply.status_code >= 400:
        error = reply.json()["error"]
        assert isinstance(error["message"], str) and error["message"], reply.text
    return reply


FUZZ = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@FUZZ
@given(route=st.sampled_from(ROUTES), body=JSON)
def test_any_json_body(url, route, body):
    answered(url, route, json.dumps(body).encode())


@FUZZ
@given(route=st.sampled_from(ROUTES), data=st.data())
def test_near_valid_bodies_with_fields_of_any_type(url, route, data):
    body = copy.deepcopy(BASE[route])
    for field in data.draw(st.lists(st.sampled_from(FIELDS[route]), max_size=3, unique=True)):
        body[field] = data.draw(JSON)
    if route == "/generate" and isinstance(body.get("sampling_params"), dict):
        for field in data.draw(st.lists(st.sampled_from(SAMPLING), max_size=3, unique=True)):
            body["sampling_params"][field] = data.draw(JSON)
    answered(url, route, json.dumps(body).encode())


@FUZZ
@given(route=st.sampled_from(ROUTES), content=st.binary(max_size=64))
def test_bytes_that_are_not_json(url, route, content):
    answered(url, route, content)


def test_still_serving_after_the_fuzzing(url):
    for route in ROUTES:
        reply = answered(url, route, json.dumps(BASE[route]).encode())
        assert reply.status_code == 200, reply.text
