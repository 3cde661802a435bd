"""The OpenAI layer's pure parts without sockets: request parsing, response shaping,
logprob shapes, usage, and the fan-out of concurrent generation streams."""

from __future__ import annotations

import asyncio
import math

import pytest
from fake_generation import FakeGenerationClient

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.services.tokenizer.generation import GenerationChunk, GenerationError
from radixmesh.services.tokenizer.openai_api import ClientGone, GenerationFanout
from radixmesh.services.tokenizer.openai_protocol import (
    OpenAIError,
    ServedModel,
    error_body,
    parse_body,
    parse_chat,
    parse_completion,
)
from radixmesh.services.tokenizer.openai_responses import (
    ChatResponse,
    Choice,
    CompletionResponse,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    usage,
)

MODEL = ServedModel("m", 64, 49152)
UNKNOWN_CONTEXT = ServedModel("m", 0, 49152)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_path(None)


def chunk(text: str, ids: list[int], done: int = 0, finish: FinishReason | None = None, **kw):
    return GenerationChunk("r", text, ids, 5, done, kw.pop("cached", 0), finish, **kw)


def test_completion_requests_are_prompt_major_with_seeds_per_sample(tok):
    body = {"prompt": ["a", "b c"], "n": 3, "seed": 10, "max_tokens": 4}
    parsed = parse_completion(body, tok, MODEL, "cmpl-x")
    assert [r.rid for r in parsed.requests] == [f"cmpl-x-{i}" for i in range(6)]
    assert [r.input_ids for r in parsed.requests] == [tok.encode("a")] * 3 + [tok.encode("b c")] * 3
    assert [r.params.seed for r in parsed.requests] == [10, 11, 12] * 2
    assert all(r.params.max_new_tokens == 4 for r in parsed.requests)
    assert not parsed.stream and parsed.top_logprobs is None and parsed.echo == []


def test_sglang_sampling_seed_is_the_seed(tok):
    parsed = parse_completion({"prompt": "a", "sampling_seed": 10}, tok, MODEL, "c")
    assert [r.params.seed for r in parsed.requests] == [10]
    with pytest.raises(OpenAIError, match=r"sampling_seed \(10\) and seed \(11\)") as refused:
        parse_completion({"prompt": "a", "seed": 11, "sampling_seed": 10}, tok, MODEL, "c")
    assert refused.value.status == 400 and refused.value.param == "sampling_seed"


def test_logit_bias_reaches_every_sample(tok):
    body = {"prompt": "a", "n": 2, "logit_bias": {"11": 100, "12": -100.0}}
    parsed = parse_completion(body, tok, MODEL, "c")
    assert [r.params.logit_bias for r in parsed.requests] == [{11: 100.0, 12: -100.0}] * 2
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"3": 1}},
                      tok, MODEL, "chat")
    assert chat.requests[0].params.logit_bias == {3: 1.0}


def test_completion_echo_and_logprobs(tok):
    ids = tok.encode("hello world")
    parsed = parse_completion({"prompt": ids, "echo": True, "logprobs": 3}, tok, MODEL, "c")
    assert parsed.echo == ["hello world"] and parsed.top_logprobs == 3
    wanted = parsed.requests[0].logprobs
    assert (wanted.return_logprob, wanted.top_logprobs_num, wanted.logprob_start_len) == (
        True,
        3,
        0,
    )
    assert parsed.requests[0].params.max_new_tokens == 16


def test_include_usage_only_when_streaming(tok):
    body = {"prompt": "x", "stream_options": {"include_usage": True}}
    assert not parse_completion(body, tok, MODEL, "c").include_usage
    assert parse_completion({**body, "stream": True}, tok, MODEL, "c").include_usage


def test_chat_default_budget(tok):
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
    parsed = parse_chat(body, tok, ServedModel("m", 100, 49152), "chatcmpl-x")
    prompt = tok.encode(tok.apply_chat_template(body["messages"]), add_special_tokens=False)
    assert parsed.requests[0].input_ids == prompt
    assert parsed.requests[0].params.max_new_tokens == 100 - len(prompt)
    # With no engine known yet the length checks are the mesh's to make.
    parsed = parse_chat(body, tok, UNKNOWN_CONTEXT, "c")
    assert parsed.requests[0].params.max_new_tokens == 128
    assert parse_completion({"prompt": "x" * 500, "max_tokens": 10**5}, tok, UNKNOWN_CONTEXT, "c")


def test_chat_logprob_flags(tok):
    base = {"messages": [{"role": "user", "content": "u"}]}
    assert parse_chat(base, tok, MODEL, "c").top_logprobs is None
    assert parse_chat({**base, "logprobs": True}, tok, MODEL, "c").top_logprobs == 0
    parsed = parse_chat({**base, "logprobs": True, "top_logprobs": 4}, tok, MODEL, "c")
    assert parsed.top_logprobs == 4 and parsed.requests[0].logprobs.logprob_start_len == -1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": 64}, "max_tokens"),
        ({"prompt": "x " * 80}, "prompt"),
        ({"prompt": "x", "model": "other"}, "model"),
        ({"prompt": "x", "frequency_penalty": "high"}, "frequency_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "min_p": 2}, "min_p"),
        ({"prompt": "x", "priority": "high"}, "priority"),
        ({"prompt": "x", "priority": 1.5}, "priority"),
        ({"prompt": "x", "priority": 2**40}, "priority"),
    ],
)
def test_completion_errors_name_the_field(tok, body, param):
    with pytest.raises(OpenAIError) as err:
        parse_completion(body, tok, MODEL, "c")
    assert err.value.param == param and err.value.status == 400
    assert "max_new_tokens" not in err.value.message


def test_parse_body():
    assert parse_body(b'{"a": 1}') == {"a": 1}
    for raw in (b"", b"nope", b"3", b'"s"'):
        with pytest.raises(OpenAIError):
            parse_body(raw)


def test_error_body_types():
    assert error_body("m", 400, "n") == {
        "error": {"message": "m", "type": "invalid_request_error", "param": "n", "code": None}
    }
    assert error_body("m", 404)["error"]["type"] == "not_found_error"
    assert error_body("m", 503)["error"]["type"] == "server_error"


def test_finish_reasons():
    assert finish_reason(None) is None
    assert finish_reason(FinishReason(FinishKind.STOP, 2)) == "stop"
    assert finish_reason(FinishReason(FinishKind.LENGTH, 3)) == "length"
    with pytest.raises(GenerationError, match="gone") as err:
        finish_reason(FinishReason(FinishKind.ABORT, message="gone"))
    assert err.value.status == 503


def test_usage_counts_a_prompt_once_per_n():
    choices = [Choice(prompt_tokens=5, completion_tokens=2, cached_tokens=c) for c in (0, 4)]
    choices += [Choice(prompt_tokens=3, completion_tokens=1, cached_tokens=2)] * 2
    assert usage(choices, 2) == {
        "prompt_tokens": 8,
        "completion_tokens": 6,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 6},
    }


def test_completion_logprob_shape(tok):
    hi, there = tok.encode("hi there")
    entries = [(None, hi, None), (-0.5, there, None), (-math.inf, 2, "<eos>")]
    tops = [None, [(-0.5, there, None), (-1.5, hi, None)], []]
    out = completion_logprobs(tok, entries, tops, 10)
    assert out == {
        "tokens": ["hi", " there", "<eos>"],
        "token_logprobs": [None, -0.5, -9999.0],
        "top_logprobs": [None, {" there": -0.5, "hi": -1.5}, {"<eos>": -9999.0}],
        "text_offset": [10, 12, 18],
    }


def test_chat_logprob_shape(tok):
    [e] = tok.encode("é")
    out = chat_logprobs(tok, [(-0.25, e, None)], [[(-0.25, e, None)]])
    item = {"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9]}
    assert out == [{**item, "top_logprobs": [item]}]


def test_completion_response_with_echo(tok):
    parsed = parse_completion({"prompt": "Hi", "echo": True, "n": 2}, tok, MODEL, "cmpl-1")
    builder = CompletionResponse(parsed, "m", 7, tok)
    for index in (0, 1):
        builder.add(index, chunk(" a", [1], 1, cached=index))
        builder.add(index, chunk("b", [2], 2, FinishReason(FinishKind.LENGTH, 2), cached=index))
    out = builder.response()
    assert {k: out[k] for k in ("id", "object", "created", "model")} == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 7,
        "model": "m",
    }
    assert out["choices"][1] == {
        "index": 1,
        "text": "Hi ab",
        "logprobs": None,
        "finish_reason": "length",
    }
    assert out["usage"]["prompt_tokens"] == 5 and out["usage"]["completion_tokens"] == 4
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}


def test_chat_stream_chunks(tok):
    body = {"messages": [{"role": "user", "content": "u"}], "stream": True}
    body["stream_options"] = {"include_usage": True}
    builder = ChatResponse(parse_chat(body, tok, MODEL, "chatcmpl-1"), "m", 7, tok)
    [start] = builder.start_chunks()
    assert start["object"] == "chat.completion.chunk" and start["usage"] is None
    assert start["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    [delta] = builder.delta_chunks(0, chunk("Hey", [5], 1))
    assert delta["choices"][0]["delta"] == {"content": "Hey"}
    assert builder.delta_chunks(0, chunk("", [6], 2)) == []
    [finish] = builder.delta_chunks(0, chunk("", [2], 3, FinishReason(FinishKind.STOP, 2)))
    assert finish["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    ]
    last = builder.usage_chunk()
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3


class _Stream:
    """A generation stream that never ends; it reports when it is first awaited."""

    def __init__(self, started: asyncio.Queue[_Stream], rid: str) -> None:
        self.rid, self.started, self.closed = rid, started, False

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> GenerationChunk:
        self.started.put_nowait(self)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        self.closed = True


def test_fanout_closes_streams_on_exit(tok):
    fake = FakeGenerationClient(tok)
    requests = parse_completion({"prompt": "x", "n": 3}, tok, MODEL, "c").requests

    async def main() -> None:
        started: asyncio.Queue[_Stream] = asyncio.Queue()
        fake.generate = lambda request, stream=True: _Stream(  # type: ignore[method-assign]
            started, request.rid)
        async with GenerationFanout(fake, requests) as fanout:
            streams = [await started.get() for _ in requests]
            fanout.client_gone()
            with pytest.raises(ClientGone):
                await anext(fanout)
        assert sorted((s.rid, s.closed) for s in streams) == [(f"c-{i}", True) for i in range(3)]

    asyncio.run(main())


def test_fanout_merges_and_raises_mesh_errors(tok):
    fake = FakeGenerationClient(tok)
    requests = parse_completion({"prompt": "x", "n": 2, "max_tokens": 3}, tok, MODEL, "c").requests

    async def main() -> None:
        async with GenerationFanout(fake, requests) as fanout:
            got = [(index, c.completion_tokens) async for index, c in fanout]
        assert sorted(got) == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
        assert [i for i, _ in got] != [0, 0, 0, 1, 1, 1]  # interleaved, not one after the other
        fake.error = GenerationError("busy", 429)
        async with GenerationFanout(fake, requests) as fanout:
            with pytest.raises(GenerationError, match="busy"):
                await anext(fanout)

    asyncio.run(main())


def test_priority_is_an_extra_integer_field(tok):
    base = {"messages": [{"role": "user", "content": "u"}]}
    assert parse_chat({**base, "priority": 7}, tok, MODEL, "c").requests[0].priority == 7
    assert parse_completion({"prompt": "x"}, tok, MODEL, "c").requests[0].priority == 0
    with pytest.raises(OpenAIError) as err:
        parse_chat({**base, "priority": "7"}, tok, MODEL, "c")
    assert err.value.param == "priority" and err.value.status == 400
