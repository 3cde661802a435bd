"""The front doors through `radixmesh up` on the real model. The API key: HTTP and gRPC
refuse a missing or wrong key (401 / UNAUTHENTICATED) and serve the right one, the openai
client works with it, probes stay open, and the key shows up in no log, no /server_info and
no command line. Admission: past max_queued_requests a request gets 503 with Retry-After,
and the next ones are served once the queue drains. Tenants separated by cache_salt never
share a cached prefix."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from process_helpers import running_mesh

from radixmesh.launcher import Mesh
from radixmesh.proto import generate_pb2 as gpb
from radixmesh.proto import generate_pb2_grpc as ggrpc
from radixmesh.services.tokenizer.auth import key_matches

KEY = "sk-test-7f3a9c1e5b"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"temperature": 0, "max_new_tokens": 4}
MAX_QUEUED = 1


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("front-doors-logs")


@pytest.fixture(scope="module")
def mesh(log_dir: Path) -> Iterator[Mesh]:
    with running_mesh(log_dir, api_key=KEY, max_queued_requests=MAX_QUEUED,
                      max_total_tokens=4096) as m:
        yield m


def test_key_matching():
    assert key_matches(KEY, f"Bearer {KEY}") and key_matches(KEY, f"bearer  {KEY} ")
    assert not key_matches(KEY, KEY) and not key_matches(KEY, "Bearer wrong")
    assert not key_matches(KEY, None) and not key_matches(KEY, f"Basic {KEY}")


def test_http_needs_the_key_and_probes_do_not(mesh):
    body = {"text": "Hello", "sampling_params": GREEDY}
    missing = httpx.post(mesh.url + "/generate", json=body, timeout=60)
    assert missing.status_code == 401
    assert missing.json()["error"]["message"].startswith("missing API key")
    wrong = httpx.post(mesh.url + "/generate", json=body, timeout=60,
                       headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(mesh.url + "/v1/models", timeout=10).status_code == 401
    ok = httpx.post(mesh.url + "/generate", json=body, timeout=60,
                    headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 4
    assert httpx.get(mesh.url + "/health", timeout=10).status_code == 200
    assert httpx.get(mesh.url + "/metrics", timeout=10).status_code == 200


def test_the_openai_client_sends_the_key(mesh):
    good = openai.OpenAI(base_url=mesh.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    model = good.models.list().data[0].id
    out = good.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4
    bad = openai.OpenAI(base_url=mesh.url + "/v1", api_key="nope", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model, prompt="Hello", max_tokens=4)


def test_grpc_needs_the_key_and_health_does_not(mesh):
    request = gpb.GenerateRequest(
        text="Hello", sampling_params=gpb.ClientSamplingParams(max_new_tokens=4, temperature=0)
    )

    async def call(metadata: tuple[tuple[str, str], ...] | None) -> list[gpb.GenerateResponse]:
        async with grpc.aio.insecure_channel(mesh.grpc_addrs[0]) as channel:
            return [r async for r in ggrpc.GenerateStub(channel).Generate(request,
                                                                          metadata=metadata)]

    async def health() -> int:
        async with grpc.aio.insecure_channel(mesh.grpc_addrs[0]) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest())
            return reply.status

    for metadata, message in [(None, "missing API key"),
                              ((("authorization", "Bearer nope"),), "invalid API key")]:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(call(metadata))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert refused.value.details() == message
    responses = asyncio.run(call((("authorization", f"Bearer {KEY}"),)))
    assert responses[-1].completion_tokens == 4
    assert asyncio.run(health()) == health_pb2.HealthCheckResponse.SERVING


def test_past_max_queued_requests_is_503_with_retry_after_then_served(mesh):
    body = {"text": "Tell me a long story about a lighthouse.",
            "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=mesh.url, headers=AUTH, timeout=120) as client:
            return list(await asyncio.gather(*(client.post("/generate", json=body)
                                               for _ in range(6))))

    replies = asyncio.run(burst())
    statuses = sorted(r.status_code for r in replies)
    assert set(statuses) == {200, 503} and statuses.count(200) >= MAX_QUEUED, statuses
    for reply in replies:
        if reply.status_code == 503:
            assert reply.headers["Retry-After"] == "1"
            assert "(max_queued_requests 1); retry later" in reply.json()["error"]["message"]
        else:
            assert reply.json()["meta_info"]["completion_tokens"] == 8, reply.json()
    # The queue drained: served again, and the refusals were counted.
    again = httpx.post(mesh.url + "/generate", json=body, headers=AUTH, timeout=120)
    assert again.status_code == 200
    metrics = httpx.get(mesh.url + "/metrics", timeout=10).text
    refused = statuses.count(503)
    assert f'radixmesh:num_overloaded_requests_total{{model_name="{_model(mesh)}"}} ' \
           f"{float(refused)}" in metrics


def _model(mesh: Mesh) -> str:
    return httpx.get(mesh.url + "/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"]


def test_tenants_never_share_a_cached_prefix(mesh):
    headers = AUTH
    prompt = "A long shared preamble about the weather in many towns. " * 6

    def cached(salt: str) -> int:
        body = {"text": prompt, "sampling_params": GREEDY, "cache_salt": salt}
        reply = httpx.post(mesh.url + "/generate", json=body, headers=headers, timeout=60)
        return reply.json()["meta_info"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # the same prompt, another tenant: nothing shared
    assert cached("tenant-a") > 50  # its own prefix is there


def test_the_key_is_never_shown(mesh, log_dir):
    info = httpx.get(mesh.url + "/server_info", timeout=10,
                     headers={"Authorization": f"Bearer {KEY}"}).json()
    assert KEY not in str(info)
    # The default mesh serves the bundled GGUF in its own quantized types.
    assert [e["quantization"] for e in info["internal_states"]] == ["gguf"]
    for log in log_dir.iterdir():
        assert KEY not in log.read_text(errors="replace"), log.name
    for child in mesh.children:
        assert KEY not in " ".join(child.proc.args), child.name
