"""Embeddings and reranking through the mesh's front doors on the real SmolLM2 served with
--is-embedding and --rerank-tokens yes,no: the openai client's embeddings.create (base64, as
it asks by default, and float), SGLang's /encode, gRPC Embed, /v1/rerank; each vector and
score equals the in-process Engine's, a shared prefix is computed once, and what an
embedding server cannot do is refused with a 400 naming the field."""

from __future__ import annotations

import asyncio
import base64
import math
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest
import torch
from process_helpers import running_mesh

from radixmesh.api import Engine
from radixmesh.launcher import Mesh
from radixmesh.proto import generate_pb2 as gpb
from radixmesh.proto import generate_pb2_grpc as ggrpc

TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors.",
         "A cat sat on the mat."]
HIDDEN = 576


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine(dtype="float32", is_embedding=True, rerank_tokens="yes,no",
                max_total_tokens=4096, show_progress=False) as e:
        yield e


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("mesh-logs"), dtype="float32",
                      is_embedding=True, rerank_tokens="yes,no", max_total_tokens=4096) as m:
        yield m


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=mesh.url, timeout=120) as c:
        yield c


def assert_close(ours: list[float], theirs: list[float]) -> None:
    a, b = torch.tensor(ours), torch.tensor(theirs)
    assert a.shape == b.shape
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) >= 0.99999
    assert (a - b).abs().max() <= 1e-4


def test_the_openai_client_gets_the_engines_vectors(mesh: Mesh, engine: Engine):
    expected = [r["embedding"] for r in engine.encode(TEXTS)]
    sdk = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused")
    model = sdk.models.list().data[0].id
    answer = sdk.embeddings.create(model=model, input=TEXTS)  # base64, as the client asks
    assert [d.index for d in answer.data] == [0, 1, 2]
    for datum, theirs in zip(answer.data, expected, strict=True):
        assert_close(datum.embedding, theirs)
        assert math.isclose(math.fsum(v * v for v in datum.embedding), 1.0, rel_tol=1e-5)
    tokens = sum(len(engine.tokenizer.encode(t)) for t in TEXTS)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == tokens
    floats = sdk.embeddings.create(model=model, input=TEXTS[0],
                                   encoding_format="float", dimensions=64)
    short = engine.encode(TEXTS[0], dimensions=64)["embedding"]
    assert len(floats.data[0].embedding) == 64
    assert_close(floats.data[0].embedding, short)


def test_base64_is_little_endian_float32(client: httpx.Client, engine: Engine):
    body = client.post("/v1/embeddings", json={"input": [[1, 2, 3, 4]],
                                               "encoding_format": "base64"}).json()
    raw = base64.b64decode(body["data"][0]["embedding"])
    vector = torch.frombuffer(bytearray(raw), dtype=torch.float32).tolist()
    assert_close(vector, engine.encode(input_ids=[1, 2, 3, 4])["embedding"])


def test_encode_answers_as_sglang_and_reuses_a_shared_prefix(client: httpx.Client,
                                                               engine: Engine):
    shared = "Represent this sentence for searching relevant passages: " * 4
    texts = [shared + "what is a cat?", shared + "what is a dog?"]
    client.get("/flush_cache")
    first = client.post("/encode", json={"text": texts[0], "rid": "enc-1"})
    assert first.status_code == 200, first.text
    one = first.json()
    assert one["meta_info"]["id"] == "enc-1" and one["meta_info"]["cached_tokens"] == 0
    assert one["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode(texts[0]))
    second = client.post("/encode", json={"text": [texts[1]]}).json()
    assert isinstance(second, list) and len(second) == 1
    # The shared instruction was computed once: the second prompt found it cached.
    common = 0
    for a, b in zip(engine.tokenizer.encode(texts[0]), engine.tokenizer.encode(texts[1]),
                    strict=False):
        if a != b:
            break
        common += 1
    assert second[0]["meta_info"]["cached_tokens"] >= common - 16 > 0
    expected = engine.encode(texts)
    assert_close(one["embedding"], expected[0]["embedding"])
    assert_close(second[0]["embedding"], expected[1]["embedding"])
    info = client.get("/get_model_info").json()
    assert info["is_generation"] is False and info["hidden_size"] == HIDDEN


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": [1.5]}, "input"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": "hi", "dimensions": HIDDEN + 1}, "dimensions"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ("/v1/embeddings", {"input": "hi", "model": "another-model"}, "model"),
    ("/v1/embeddings", {"input": "hi", "model": 7}, "model"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "model": ["m"]}, "model"),
    ("/v1/embeddings", {"input": [[7] * 9000]}, "input"),  # past the 8192 context
    ("/v1/completions", {"prompt": "hi"}, None),
])
def test_bad_openai_requests_get_a_400_naming_the_field(client: httpx.Client, path, body, field):
    answer = client.post(path, json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == field
    if field is None:
        assert "embedding model" in error["message"]


def test_bad_native_requests_get_a_400(client: httpx.Client):
    for body, words in [({"text": "hi", "dimensions": "8"}, "dimensions"),
                        ({}, "exactly one of text and input_ids"),
                        ({"input_ids": [[1, 2], "x"]}, "input_ids"),
                        ({"text": "hi", "rid": ["a", "b"]}, "rid")]:
        answer = client.post("/encode", json=body)
        assert answer.status_code == 400 and words in answer.text, answer.text
    answer = client.post("/encode", content=b"{not json")
    assert answer.status_code == 400 and "JSON" in answer.text
    generate = client.post("/generate", json={"text": "hi"})
    assert generate.status_code == 400 and "embedding model" in generate.text
    # Nothing refused above holds a slot; the server still embeds.
    assert client.post("/encode", json={"text": "still here"}).status_code == 200


def test_grpc_embed(mesh: Mesh, engine: Engine):
    async def call(request: gpb.EmbedRequest) -> gpb.EmbedResponse:
        async with grpc.aio.insecure_channel(mesh.grpc_addrs[0]) as channel:
            return await ggrpc.GenerateStub(channel).Embed(request)

    answer = asyncio.run(call(gpb.EmbedRequest(text=TEXTS[1], rid="g-1", dimensions=32)))
    assert answer.rid == "g-1" and answer.prompt_tokens == len(engine.tokenizer.encode(TEXTS[1]))
    assert_close(list(answer.embedding), engine.encode(TEXTS[1], dimensions=32)["embedding"])
    for bad, words in [(gpb.EmbedRequest(text="hi", dimensions=HIDDEN + 1), "dimensions"),
                       (gpb.EmbedRequest(), "text or input_ids"),
                       (gpb.EmbedRequest(input_ids=gpb.TokenIds(ids=[])), "input_ids")]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(call(bad))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert words in (err.value.details() or "")


QUERY = "Which animal purrs when it is happy and likes to chase mice around the house?"
DOCUMENTS = ["Cats purr when they are content.", "The stock market fell on Monday.",
             {"text": "Dogs bark at strangers."}, "Mice are small rodents."]


def test_rerank_scores_sorts_and_echoes_as_asked(client: httpx.Client, engine: Engine):
    texts = [d if isinstance(d, str) else d["text"] for d in DOCUMENTS]
    expected = {r["index"]: r["relevance_score"] for r in engine.rerank(QUERY, texts)}
    client.get("/flush_cache")
    answer = client.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    results = body["results"]
    assert [r["index"] for r in results] == sorted(expected, key=lambda i: -expected[i])
    for r in results:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-4)
        assert r["document"] == {"text": texts[r["index"]]}
    # Every document after the first found the template's start and the query cached.
    prompts = [engine.tokenizer.encode(engine.reranker.prompt(QUERY, t)) for t in texts]
    shared = min(_common(prompts[0], p) for p in prompts[1:])
    assert shared > 80
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * shared
    top = client.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                       "return_documents": False}).json()["results"]
    assert [r["index"] for r in top] == [r["index"] for r in results[:2]]
    assert all("document" not in r for r in top)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize(("body", "field"), [
    ({"documents": ["a"]}, "query"),
    ({"query": "q", "documents": []}, "documents"),
    ({"query": "q", "documents": [{"title": "a"}]}, "documents"),
    ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ({"query": "q", "documents": ["a"], "return_documents": "yes"}, "return_documents"),
])
def test_bad_rerank_requests_get_a_400_naming_the_field(client: httpx.Client, body, field):
    answer = client.post("/v1/rerank", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == field
