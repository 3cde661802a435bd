"""The SGLang-native HTTP API of a tokenizer replica, served in front of fake engines on a
real NATS server; including the exact requests SGLang's own clients send and what they read."""

from __future__ import annotations

import asyncio
import json
import os

import aiohttp
import nats
import pytest
from fake_engine import (
    MOE_SHAPE,
    FakeEngine,
    echo_ids,
    host_part,
    input_logprob,
    output_logprob,
    token_text,
)

from radixmesh.core.service_settings import TokenizerServiceConfig
from radixmesh.services.tokenizer.server import TokenizerServer

pytestmark = pytest.mark.anyio

CONTEXT = 256


class Stack:
    """One tokenizer replica, its HTTP client, and fake engines to add."""

    def __init__(self, server: TokenizerServer, nc, http: aiohttp.ClientSession) -> None:
        self.server = server
        self.nc = nc
        self.http = http
        self.url = f"http://127.0.0.1:{server.port}"
        self.engines: list[FakeEngine] = []

    async def add_engine(self, **options) -> FakeEngine:
        options.setdefault("context_length", CONTEXT)
        engine = await FakeEngine(self.nc, f"e-{os.urandom(3).hex()}", **options).start()
        self.engines.append(engine)
        assert self.server.client is not None
        await self.server.client.wait_for_engines(len(self.engines))
        return engine

    async def post(self, path: str, body: object) -> tuple[int, object]:
        async with self.http.post(self.url + path, json=body) as resp:
            return resp.status, await resp.json()

    async def get(self, path: str) -> tuple[int, object]:
        async with self.http.get(self.url + path) as resp:
            return resp.status, await resp.json(content_type=None)

    async def stream(self, body: object) -> list[bytes]:
        async with self.http.post(self.url + "/generate", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            return [line async for line in resp.content]


@pytest.fixture
async def stack(nats_url, tokenizer, request):
    """Indirectly parametrized: more settings of the replica."""
    config = TokenizerServiceConfig(nats_url=nats_url, port=0, grpc_port=-1,
                                    replica_id=os.urandom(6).hex(),
                                    **getattr(request, "param", {}))
    server = TokenizerServer(config, tokenizer=tokenizer)
    await server.start()
    nc = await nats.connect(nats_url)
    async with aiohttp.ClientSession() as http:
        s = Stack(server, nc, http)
        yield s
        for engine in s.engines:
            await engine.stop()
    await nc.close()
    await server.stop()


def _events(lines: list[bytes]) -> list[object]:
    """SSE lines as SGLang's clients split them: every non-empty line is `data: ...`."""
    events = []
    for line in lines:
        if not line.strip():
            continue
        assert line.startswith(b"data: ") and line.endswith(b"\n"), line
        payload = line[len(b"data: "):].strip()
        events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


# ---- /generate ---------------------------------------------------------------------------


async def test_generate_single(stack):
    await stack.add_engine()
    status, body = await stack.post("/generate", {
        "input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 4}, "rid": "one",
    })
    assert status == 200
    assert body["text"] == "".join(token_text(t) for t in echo_ids([7, 8, 9], 4))
    assert body["output_ids"] == [7, 8, 9, 7]
    meta = body["meta_info"]
    assert meta["id"] == "one"
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 4, 0)
    assert meta["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 0}
    assert meta["e2e_latency"] > 0
    assert "output_token_logprobs" not in meta
    assert list(meta) == ["id", "finish_reason", "prompt_tokens", "completion_tokens",
                          "cached_tokens", "cached_tokens_details", "e2e_latency"]


async def test_cached_tokens_details_split_the_hit_by_tier(stack):
    await stack.add_engine()
    body = {"input_ids": [50, 51, 52, 53, 54, 55, 56], "sampling_params": {"max_new_tokens": 2}}
    await stack.post("/generate", body)
    status, warm = await stack.post("/generate", {**body, "input_ids": [50, 51, 52, 53, 54, 9]})
    assert status == 200
    host = host_part(5)
    assert host > 0  # the fake engine says part of the hit came back from the host tier
    details = {"device": 5 - host, "host": host, "storage": 0}
    assert warm["meta_info"]["cached_tokens"] == 5
    assert warm["meta_info"]["cached_tokens_details"] == details
    events = _events(await stack.stream({**body, "stream": True}))[:-1]
    full = {"device": 7 - host_part(7), "host": host_part(7), "storage": 0}
    assert events and all(e["meta_info"]["cached_tokens"] == 7 for e in events)
    assert all(e["meta_info"]["cached_tokens_details"] == full for e in events)


async def test_generate_text_is_tokenized_and_sampling_reaches_the_engine(stack, tokenizer):
    engine = await stack.add_engine()
    status, body = await stack.post("/generate", {
        "text": "The capital of France is",
        "sampling_params": {"max_new_tokens": 2, "temperature": 0, "top_k": 5, "stop": "\n",
                            "ignore_eos": True, "skip_special_tokens": False},
        "cache_salt": "tenant", "priority": 3,
    })
    assert status == 200
    sent = engine.requests[0]
    assert list(sent.input_ids) == tokenizer.encode("The capital of France is")
    assert sent.sampling.temperature == 0 and sent.sampling.top_k == 5
    assert sent.sampling.ignore_eos and not sent.detok.skip_special_tokens
    assert list(sent.detok.stop) == ["\n"]
    assert sent.cache_salt == "tenant" and sent.priority == 3
    assert body["meta_info"]["prompt_tokens"] == len(sent.input_ids)


async def test_sglang_sampling_fields_reach_the_engine(stack):
    engine = await stack.add_engine()
    status, _ = await stack.post("/generate", {"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 2, "logit_bias": {"7": -100, "9": 2.5}, "stop_token_ids": [4],
        "ignore_eos": True, "skip_special_tokens": False, "spaces_between_special_tokens": False,
        "no_stop_trim": True,
    }})
    assert status == 200
    sent = engine.requests[0]
    assert dict(sent.sampling.logit_bias) == {7: -100.0, 9: 2.5}
    assert list(sent.sampling.stop_token_ids) == [4] and sent.sampling.ignore_eos
    detok = sent.detok
    assert not detok.skip_special_tokens and not detok.spaces_between_special_tokens
    assert detok.no_stop_trim
    await stack.post("/generate", {"input_ids": [1, 2]})
    assert engine.requests[1].detok.spaces_between_special_tokens  # SGLang's default


async def test_sglang_names_of_seed_and_cache_salt_reach_the_engine(stack):
    engine = await stack.add_engine()
    for body in ({"sampling_params": {"sampling_seed": 1234, "temperature": 0.7}, "extra_key": "t"},
                 {"sampling_params": {"seed": 1234, "sampling_seed": 1234, "temperature": 0.7},
                  "cache_salt": "t", "extra_key": "t"}):
        status, _ = await stack.post("/generate", {"input_ids": [1, 2], **body})
        assert status == 200
    for sent in engine.requests:
        assert sent.sampling.seed == 1234 and sent.cache_salt == "t"


async def test_n_samples_of_one_prompt_answer_a_list(stack):
    engine = await stack.add_engine()
    status, body = await stack.post("/generate", {
        "input_ids": [1, 2], "rid": "q", "sampling_params": {"n": 3, "max_new_tokens": 2},
    })
    assert status == 200 and isinstance(body, list) and len(body) == 3
    assert [b["meta_info"]["id"] for b in body] == ["q_0", "q_1", "q_2"]
    assert all(b["output_ids"] == [1, 2] for b in body)
    assert all(b["meta_info"]["finish_reason"] == {"type": "length", "length": 2} for b in body)
    # The prompt is prefilled once, generating nothing, before the samples start.
    prefill, *samples = engine.requests
    assert prefill.rid == "q_prefix" and prefill.sampling.max_new_tokens == 0
    assert [r.rid for r in samples] == ["q_0", "q_1", "q_2"]
    assert len({r.sampling.seed for r in samples}) == 3
    engine.requests.clear()
    status, body = await stack.post("/generate", {
        "input_ids": [1], "sampling_params": {"n": 2, "seed": 40, "max_new_tokens": 1},
    })
    assert status == 200 and len(body) == 2
    assert [r.sampling.seed for r in engine.requests[1:]] == [40, 41]


async def test_n_samples_of_a_batch_are_prompt_major(stack):
    await stack.add_engine()
    status, body = await stack.post("/generate", {
        "input_ids": [[1], [2, 2]], "rid": ["a", "b"],
        "sampling_params": {"n": 2, "max_new_tokens": 1},
    })
    assert status == 200
    assert [b["meta_info"]["id"] for b in body] == ["a_0", "a_1", "b_0", "b_1"]
    assert [b["output_ids"] for b in body] == [[1], [1], [2], [2]]


def assert_cumulative(outputs: list[list[int]], whole: list[int]) -> None:
    """Streamed events carry the output so far, as SGLang's: each extends the one before and
    the last is whole (a reader that fell behind gets several tokens in one event)."""
    assert outputs and outputs[-1] == whole
    assert all(o and o == whole[: len(o)] for o in outputs)
    assert [len(o) for o in outputs] == sorted({len(o) for o in outputs})


async def test_n_samples_stream_events_carry_their_index(stack):
    await stack.add_engine(delay_s=0.001)
    events = _events(await stack.stream({
        "input_ids": [3, 4], "sampling_params": {"n": 2, "max_new_tokens": 2}, "stream": True,
    }))
    assert events[-1] == "[DONE]"
    by_index: dict[int, list] = {0: [], 1: []}
    for event in events[:-1]:
        by_index[event["index"]].append(event)
    for index, chunks in by_index.items():
        assert_cumulative([c["output_ids"] for c in chunks], [3, 4])
        assert chunks[-1]["meta_info"]["id"].endswith(f"_{index}")
        assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 2}


async def test_generate_batch(stack):
    await stack.add_engine()
    status, body = await stack.post("/generate", {
        "text": ["a b", "c d e"],
        "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 3}],
        "rid": ["r1", "r2"],
    })
    assert status == 200 and isinstance(body, list)
    assert [b["meta_info"]["id"] for b in body] == ["r1", "r2"]
    assert [b["meta_info"]["completion_tokens"] for b in body] == [1, 3]
    status, body = await stack.post("/generate", {
        "input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 2},
    })
    assert status == 200
    assert [b["output_ids"] for b in body] == [[1, 2], [3, 3]]


async def test_default_max_new_tokens_shrinks_to_fit_the_context(stack):
    engine = await stack.add_engine()
    status, body = await stack.post("/generate", {"input_ids": [1] * (CONTEXT - 10)})
    assert status == 200
    assert engine.requests[0].sampling.max_new_tokens == 10
    status, _ = await stack.post("/generate", {"input_ids": [1] * 10})
    assert engine.requests[1].sampling.max_new_tokens == 128


async def test_generate_stream_sends_cumulative_events_then_done(stack):
    await stack.add_engine()
    lines = await stack.stream({
        "input_ids": [4, 5], "sampling_params": {"max_new_tokens": 3}, "stream": True,
    })
    assert all(line.startswith(b"data: ") or line == b"\n" for line in lines)
    events = _events(lines)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    texts = [token_text(t) for t in echo_ids([4, 5], 3)]
    # Cumulative: each event has the whole output so far (tokens that came together share
    # an event).
    for c in chunks:
        n = c["meta_info"]["completion_tokens"]
        assert c["output_ids"] == [4, 5, 4][:n] and c["text"] == "".join(texts[:n]), c
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts == sorted(set(counts)) and counts[-1] == 3
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


@pytest.mark.parametrize("stack", [{"incremental_streaming_output": True}], indirect=True)
async def test_incremental_streaming_output_sends_each_segment_once(stack):
    """--incremental-streaming-output: each event carries the text, output ids and output
    logprobs new since the last one; together they are the whole answer, logprobs and all."""
    await stack.add_engine(delay_s=0.001)
    body = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 7},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    status, whole = await stack.post("/generate", body)
    assert status == 200
    events = _events(await stack.stream({**body, "stream": True}))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) > 1
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"] == echo_ids(
        [4, 5, 6], 7)
    for key in ("output_token_logprobs", "output_top_logprobs"):
        assert [x for c in chunks for x in c["meta_info"][key]] == whole["meta_info"][key]
    assert [len(c["output_ids"]) for c in chunks] == [
        len(c["meta_info"]["output_token_logprobs"]) for c in chunks]
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts == sorted(set(counts)) and counts[-1] == 7
    final = chunks[-1]["meta_info"]
    assert final["input_token_logprobs"] == whole["meta_info"]["input_token_logprobs"]


async def test_generate_stream_batch_tags_events_with_their_index(stack):
    await stack.add_engine(delay_s=0.001)
    events = _events(await stack.stream({
        "input_ids": [[1], [2, 2]], "sampling_params": {"max_new_tokens": 2}, "stream": True,
    }))
    assert events[-1] == "[DONE]"
    by_index: dict[int, list] = {0: [], 1: []}
    for event in events[:-1]:
        by_index[event["index"]].append(event)
    assert_cumulative([e["output_ids"] for e in by_index[0]], [1, 1])
    assert_cumulative([e["output_ids"] for e in by_index[1]], [2, 2])


async def test_out_of_order_chunks_reach_the_client_in_order(stack):
    await stack.add_engine(reverse=True, extra_finish=True)
    status, body = await stack.post("/generate", {
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 6},
    })
    assert status == 200
    assert body["output_ids"] == echo_ids([1, 2, 3], 6)
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


async def test_logprobs_pass_through(stack):
    await stack.add_engine()
    prompt = [30, 31, 32, 33]
    status, body = await stack.post("/generate", {
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 2},
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
    })
    assert status == 200
    meta = body["meta_info"]
    assert meta["input_token_logprobs"][0] == [None, 30, None]
    assert meta["input_token_logprobs"][1:] == [
        [pytest.approx(input_logprob(p)), prompt[p], None] for p in range(1, 4)
    ]
    assert meta["output_token_logprobs"] == [
        [pytest.approx(output_logprob(i)), t, None] for i, t in enumerate([30, 31])
    ]
    assert meta["input_top_logprobs"][0] is None
    assert meta["input_top_logprobs"][2] == [[-1.0, 32, None], [-2.0, 33, None]]
    assert meta["output_top_logprobs"][1] == [[-1.0, 31, None], [-2.0, 32, None]]


async def test_logprobs_with_token_text(stack, tokenizer):
    await stack.add_engine()
    ids = tokenizer.encode("Hello world")
    status, body = await stack.post("/generate", {
        "input_ids": ids, "sampling_params": {"max_new_tokens": 1},
        "return_logprob": True, "logprob_start_len": 0, "return_text_in_logprobs": True,
    })
    assert status == 200
    entries = body["meta_info"]["input_token_logprobs"]
    assert "".join(e[2] for e in entries) == "Hello world"
    assert "input_top_logprobs" not in body["meta_info"]


BAD_REQUESTS = [
    ("not json", "JSON"),
    ([1, 2], "JSON object"),
    ({}, "text or input_ids"),
    ({"text": "a", "input_ids": [1]}, "either text or input_ids"),
    ({"text": 5}, "text"),
    ({"text": []}, "text"),
    ({"text": ""}, "empty"),
    ({"input_ids": [1, "2"]}, "input_ids"),
    ({"input_ids": [1, 999999]}, "input_ids"),
    ({"input_ids": [-1]}, "input_ids"),
    ({"text": "a", "sampling_params": {"temprature": 0.5}}, "temprature"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "a", "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 1.5}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "a", "sampling_params": {"stop_token_ids": [10**9]}}, "stop_token_ids"),
    ({"text": "a", "sampling_params": {"n": 0}}, "sampling_params.n must be an integer in [1,"),
    ({"text": "a", "sampling_params": {"n": 129}}, "sampling_params.n"),
    ({"text": "a", "sampling_params": {"n": "2"}}, "sampling_params.n"),
    ({"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}, "sampling_params.n"),
    ({"text": "a", "sampling_params": {"logit_bias": {"5": 101}}}, "logit_bias values"),
    ({"text": "a", "sampling_params": {"logit_bias": {"5": "x"}}}, "logit_bias must map"),
    ({"text": "a", "sampling_params": {"logit_bias": {"tok": 1}}}, "logit_bias keys"),
    ({"text": "a", "sampling_params": {"logit_bias": {"999999": 1}}}, "logit_bias keys"),
    ({"text": "a", "sampling_params": {"logit_bias": [1]}}, "logit_bias"),
    ({"text": "a", "sampling_params": {"spaces_between_special_tokens": 1}},
     "spaces_between_special_tokens"),
    ({"text": "a", "sampling_params": {"json_schema": "{oops"}}, "json_schema is not valid JSON"),
    ({"text": "a", "sampling_params": {"json_schema": '{"type": "nope"}'}}, "invalid json_schema"),
    ({"text": "a", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "at most one"),
    ({"text": "a", "sampling_params": {"seed": 1, "sampling_seed": 2}},
     "sampling_seed (2) and seed (1) are one parameter under two names"),
    ({"text": "a", "cache_salt": "x", "extra_key": "y"},
     "extra_key ('y') and cache_salt ('x') are one field under two names"),
    ({"text": "a", "sampling_params": {"regex": 5}}, "regex must be a non-empty string"),
    ({"text": "a", "sampling_params": [{}]}, "sampling_params"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": "a", "stream": "yes"}, "stream"),
    ({"text": "a", "return_logprob": 1}, "return_logprob"),
    ({"text": "a", "top_logprobs_num": -1}, "top_logprobs_num"),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len"),
    ({"text": "a", "frobnicate": 1}, "frobnicate"),
    ({"text": "a", "lora_path": "adapter"}, "lora_path"),
    ({"text": ["a", "b"], "rid": "same"}, "rid"),
    ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
    ({"text": "a", "priority": 2**40}, "priority"),
    ({"text": "a", "priority": "high"}, "priority"),
    ({"text": "a", "sampling_params": {"top_k": 10**6}}, "top_k"),
    ({"text": "a", "sampling_params": {"seed": -1}}, "seed"),
    ({"text": "a", "return_logprob": True, "top_logprobs_num": 10**6}, "top_logprobs_num"),
    ({"input_ids": [1] * CONTEXT}, "context length"),
    ({"input_ids": [1] * 200, "sampling_params": {"max_new_tokens": 100}}, "max_new_tokens"),
]


async def test_a_constraint_its_engine_cannot_compile_is_a_400_streamed_or_not(stack):
    """The front door checks only a constraint's form; the engine compiles it, and its
    refusal (before any output) is the answer's status."""
    engine = await stack.add_engine(refuse_grammars=True)
    for stream in (False, True):
        body = {"text": "a", "sampling_params": {"regex": "([0-9]+"}, "stream": stream}
        async with stack.http.post(stack.url + "/generate", json=body) as resp:
            answer = await resp.json()
        assert resp.status == 400, answer
        assert "the regex could not be compiled" in answer["error"]["message"], answer
    assert len(engine.requests) == 2 and engine.aborts == []


async def test_each_bad_request_is_400_and_the_service_keeps_serving(stack):
    engine = await stack.add_engine()
    for body, needle in BAD_REQUESTS:
        data = body if isinstance(body, str) else json.dumps(body)
        async with stack.http.post(stack.url + "/generate", data=data) as resp:
            answer = await resp.json()
        assert resp.status == 400, (body, answer)
        error = answer["error"]
        assert error["type"] == "BadRequestError" and error["code"] == 400
        assert needle in error["message"], (body, error)
    assert engine.requests == []
    status, body = await stack.post("/generate", {"input_ids": [1], "sampling_params":
                                                  {"max_new_tokens": 1}})
    assert status == 200 and body["output_ids"] == [1]


async def test_no_engine_is_503(stack):
    status, body = await stack.post("/generate", {"text": "hi"})
    assert status == 503
    assert body["error"]["code"] == 503
    async with stack.http.post(stack.url + "/generate",
                               json={"text": "hi", "stream": True}) as resp:
        assert resp.status == 503


async def test_client_disconnect_mid_stream_aborts_the_request(stack):
    engine = await stack.add_engine(hold=True)
    resp = await stack.http.post(stack.url + "/generate", json={
        "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 50}, "stream": True,
        "rid": "gone",
    })
    first = await resp.content.readline()
    assert first.startswith(b"data: ")
    resp.close()  # drops the connection
    await engine.wait_for("aborts")
    assert engine.aborts == ["gone"]
    assert stack.server.client.in_flight == 0


# ---- the other routes --------------------------------------------------------------------


async def test_health_follows_engines_and_health_generate_probes(stack):
    assert (await stack.get("/health"))[0] == 503
    assert (await stack.get("/health_generate"))[0] == 503
    await stack.add_engine()
    status, body = await stack.get("/health")
    assert status == 200 and body["engines"] == 1
    async with stack.http.get(stack.url + "/health_generate") as resp:
        assert resp.status == 200


async def test_model_and_server_info(stack):
    status, info = await stack.get("/get_model_info")
    assert status == 200  # no engine yet: the model's shape is not known
    assert {k: info[k] for k in MOE_SHAPE} == dict.fromkeys(MOE_SHAPE)
    engine = await stack.add_engine()
    status, info = await stack.get("/get_model_info")
    assert status == 200
    assert info["model_path"].endswith(".gguf") and info["is_generation"] is True
    assert info["served_model_name"] == "SmolLM2-135M-Instruct.Q4_1"
    assert info["tokenizer_path"] == info["model_path"]
    assert info["preferred_sampling_params"] is None
    assert {k: info[k] for k in MOE_SHAPE} == MOE_SHAPE  # as the engine's heartbeat says
    for path in ("/server_info", "/get_server_info"):
        status, info = await stack.get(path)
        assert status == 200
        assert info["context_length"] == CONTEXT and info["engines"] == [engine.engine_id]
        assert {k: info[k] for k in MOE_SHAPE} == MOE_SHAPE
        assert info["internal_states"] == [{"engine_id": engine.engine_id, "fake": True}]
        assert info["port"] == 0 and info["replica_id"]


async def test_flush_cache(stack):
    async with stack.http.post(stack.url + "/flush_cache") as resp:
        assert resp.status == 503
    engine = await stack.add_engine()
    async with stack.http.post(stack.url + "/flush_cache") as resp:
        assert resp.status == 200
    async with stack.http.get(stack.url + "/flush_cache") as resp:
        assert resp.status == 200
    assert engine.flushes == 2
    engine.flush_ok = False
    async with stack.http.post(stack.url + "/flush_cache", json={"empty_cache": True}) as resp:
        assert resp.status == 400


async def test_metrics_count_requests_tokens_and_latency(stack):
    await stack.add_engine()
    await stack.post("/generate", {"input_ids": [1, 2, 3], "sampling_params":
                                   {"max_new_tokens": 2}})
    await stack.post("/generate", {"text": ""})
    async with stack.http.get(stack.url + "/metrics") as resp:
        text = await resp.text()
    for name in (
        'radixmesh:tokenizer_api_requests_total{endpoint="/generate",status="200"}',
        'radixmesh:tokenizer_api_requests_total{endpoint="/generate",status="400"}',
        "radixmesh:prompt_tokens_total",
        "radixmesh:generation_tokens_total",
        "radixmesh:time_to_first_token_seconds_bucket",
        "radixmesh:e2e_request_latency_seconds_count",
        'radixmesh:tokenizer_num_in_flight_reqs{model_name="SmolLM2-135M-Instruct.Q4_1"} 0.0',
    ):
        assert name in text, name


# ---- SGLang's own clients ----------------------------------------------------------------
# The requests below are the ones SGLang's frontend language (RuntimeEndpoint) and its
# serving benchmark (bench_serving, sglang backend) send, read the way they read them.


def _runtime_endpoint_sampling(**overrides: object) -> dict[str, object]:
    """RuntimeEndpoint.generate's sampling_params: SglSamplingParams.to_srt_kwargs()
    defaults plus its two output options."""
    params: dict[str, object] = {
        "skip_special_tokens": True, "spaces_between_special_tokens": True,
        "max_new_tokens": 128, "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [],
        "stop_regex": None, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
        "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False,
        "regex": None, "json_schema": None,
    }
    params.update(overrides)
    return params


async def test_runtime_endpoint_construction_and_generate(stack):
    await stack.add_engine()
    status, info = await stack.get("/get_model_info")  # read by its constructor
    assert status == 200 and isinstance(info["model_path"], str)
    status, obj = await stack.post("/generate", {
        "text": "Q: 1+1?\nA:", "sampling_params": _runtime_endpoint_sampling(max_new_tokens=3),
        "return_logprob": None, "logprob_start_len": None, "top_logprobs_num": None,
        "return_text_in_logprobs": None,
    })
    assert status == 200
    comp, meta = obj["text"], obj["meta_info"]
    assert isinstance(comp, str) and meta["completion_tokens"] == 3


async def test_runtime_endpoint_generate_stream(stack):
    await stack.add_engine()
    async with stack.http.post(stack.url + "/generate", json={
        "text": "Count:", "sampling_params": _runtime_endpoint_sampling(max_new_tokens=4),
        "stream": True,
    }) as resp:
        raw = await resp.read()
    # It iterates lines, keeps those starting "data:", stops at "data: [DONE]" and
    # slices each cumulative text by what it has already yielded.
    pos, pieces = 0, []
    for line in raw.split(b"\n"):
        chunk = line.decode("utf-8")
        if chunk and chunk.startswith("data:"):
            if chunk == "data: [DONE]":
                break
            data = json.loads(chunk[5:].strip("\n"))
            piece = data["text"][pos:]
            pos += len(piece)
            pieces.append((piece, data["meta_info"]))
    assert "".join(p for p, _ in pieces) == "".join(token_text(t) for t in
                                                   echo_ids_for_text(stack, "Count:", 4))
    assert pieces[-1][1]["finish_reason"]["type"] == "length"


def echo_ids_for_text(stack: Stack, text: str, n: int) -> list[int]:
    assert stack.server.client is not None
    return echo_ids(stack.server.client.tokenizer.encode(text), n)


async def test_runtime_endpoint_select(stack):
    await stack.add_engine()
    prefix = "The answer is"
    choices = [" yes", " no"]
    # 1. Cache the common prefix.
    status, obj = await stack.post("/generate", {"text": prefix,
                                                 "sampling_params": {"max_new_tokens": 0}})
    assert status == 200 and obj["meta_info"]["completion_tokens"] == 0
    prompt_len = obj["meta_info"]["prompt_tokens"]
    logprob_start_len = max(prompt_len - 2, 0)
    # 2. Logprobs of each continuation, with token texts for token healing.
    status, obj = await stack.post("/generate", {
        "text": [prefix + c for c in choices],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True, "return_text_in_logprobs": True,
        "logprob_start_len": logprob_start_len,
    })
    assert status == 200
    input_token_logprobs = [r["meta_info"]["input_token_logprobs"] for r in obj]
    output_token_logprobs = [r["meta_info"]["output_token_logprobs"] for r in obj]
    assert output_token_logprobs == [[], []]
    for entries in input_token_logprobs:
        assert len(entries) >= 2
        healed = entries[0][-1]  # it checks whether the prompt ends with this text
        assert healed == stack.server.client.tokenizer.decode([entries[0][1]])
        values = [x[0] for x in entries if x[0]]
        assert sum(values) / len(values) < 0  # its normalized prompt logprob
    # 3. Unconditional logprobs: the same tokens again, as ids.
    input_ids = [[el[1] for el in entries] for entries in input_token_logprobs]
    status, obj = await stack.post("/generate", {
        "input_ids": input_ids, "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
    })
    assert status == 200
    assert [r["meta_info"]["input_token_logprobs"] for r in obj] == [[], []]


async def test_runtime_generate_with_null_fields(stack):
    await stack.add_engine()
    status, obj = await stack.post("/generate", {
        "text": "hi", "sampling_params": None, "return_logprob": False,
        "logprob_start_len": None, "top_logprobs_num": None, "lora_path": None,
    })
    assert status == 200 and obj["meta_info"]["finish_reason"]["type"] == "length"


async def test_bench_serving_sglang_backend(stack):
    await stack.add_engine(delay_s=0.001)
    payload = {
        "text": "Tell me a story",
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True},
        "stream": True, "lora_path": None, "return_logprob": False, "logprob_start_len": -1,
    }
    generated, output_len, last_output_len, itl = "", 0, 0, 0
    async with stack.http.post(stack.url + "/generate", json=payload) as response:
        assert response.status == 200
        async for chunk_bytes in response.content:
            chunk_bytes = chunk_bytes.strip()
            if not chunk_bytes:
                continue
            chunk = chunk_bytes.decode("utf-8").removeprefix("data: ")
            if chunk == "[DONE]":
                continue
            data = json.loads(chunk)  # every other line must be JSON
            if "text" in data and data["text"]:
                generated = data["text"]
                output_len = data["meta_info"]["completion_tokens"]
                itl += output_len - last_output_len
                last_output_len = output_len
    assert output_len == 5 and itl == 5
    assert generated.startswith(token_text(echo_ids_for_text(stack, "Tell me a story", 1)[0]))
    # After the run it flushes (in CI) and reads the server's internal state.
    async with stack.http.post(stack.url + "/flush_cache") as resp:
        assert resp.status == 200
    status, server_info = await stack.get("/get_server_info")
    assert status == 200
    assert server_info["internal_states"][0].get("avg_spec_accept_length", None) is None


async def test_concurrent_streams_share_the_replica(stack):
    await stack.add_engine(delay_s=0.001)
    bodies = [{"input_ids": [i + 1] * 3, "sampling_params": {"max_new_tokens": 4},
               "stream": True} for i in range(6)]
    results = await asyncio.gather(*(stack.stream(b) for b in bodies))
    for i, lines in enumerate(results):
        events = _events(lines)
        assert events[-1] == "[DONE]"
        assert events[-2]["output_ids"] == [i + 1] * 4


# ---- SGLang's parse routes -----------------------------------------------------------------


async def test_parse_function_call_and_separate_reasoning(stack):
    tools = [{"type": "function", "function": {"name": "get_time"}},
             {"type": "function", "function": {"name": "get_weather", "parameters": {
                 "type": "object", "properties": {"city": {"type": "string"}}}}}]
    text = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>')
    status, body = await stack.post("/parse_function_call", {
        "text": text, "tool_call_parser": "qwen25", "tools": tools})
    assert status == 200
    assert body == {"normal_text": "Sure.", "calls": [
        {"tool_index": 1, "name": "get_weather", "parameters": '{"city": "Oslo"}'}]}
    status, body = await stack.post("/separate_reasoning", {
        "text": "<think>\nSunny, I guess.\n</think>\n\nSunny.", "reasoning_parser": "qwen3"})
    assert (status, body) == (200, {"text": "Sunny.", "reasoning_text": "Sunny, I guess."})
    for path, bad, fragment in (
        ("/parse_function_call", {"text": text, "tool_call_parser": "hermes", "tools": tools},
         "unknown tool-call parser 'hermes'"),
        ("/parse_function_call", {"text": text, "tool_call_parser": "qwen25", "tools": 3},
         "tools must be"),
        ("/separate_reasoning", {"text": 1, "reasoning_parser": "qwen3"}, "string text"),
        ("/separate_reasoning", {"text": "", "reasoning_parser": None}, "reasoning_parser"),
    ):
        status, body = await stack.post(path, bad)
        assert status == 400 and fragment in body["error"]["message"], body
