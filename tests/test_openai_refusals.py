"""The OpenAI routes' refusals (bad requests, malformed bodies, errors of the mesh), tool
choices, the SSE wire format and disconnects, behind a real aiohttp server with a fake mesh."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest
from fake_generation import (
    EOS_ID,
    REPLY,
    FakeGenerationClient,
)
from openai_serving import MODEL, PROMPT, USER, reply_ids, run

from radixmesh.core.tokenizer import Tokenizer
from radixmesh.services.tokenizer.generation import GenerationError


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_path(None)


# ---------------------------------------------------------------------------------- errors

BAD_CHAT: list[tuple[dict[str, Any], str, str]] = [
    ({"messages": []}, "messages", "must not be empty"),
    ({"messages": "hi"}, "messages", "must be a list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "robot"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "robot"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content",
        "text parts",
    ),
    ({"model": "gpt-4"}, "model", MODEL),
    ({"temperature": -0.5}, "temperature", "between 0 and 2"),
    ({"temperature": 2.5}, "temperature", "between 0 and 2"),
    ({"temperature": "hot"}, "temperature", "number"),
    ({"top_p": 1.5}, "top_p", "top_p"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"n": 0}, "n", "between 1 and 128"),
    ({"n": 1.5}, "n", "integer"),
    ({"max_tokens": -1}, "max_tokens", ">= 0"),
    ({"max_completion_tokens": -1}, "max_completion_tokens", ">= 0"),
    ({"max_tokens": 4000}, "max_tokens", "context length"),
    ({"messages": [{"role": "user", "content": "word " * 3000}]}, "messages", "context length"),
    ({"stop": 5}, "stop", "stop"),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"seed": "x"}, "seed", "integer"),
    ({"stream": "yes"}, "stream", "boolean"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage", "boolean"),
    ({"logprobs": 1}, "logprobs", "boolean"),
    ({"top_logprobs": 3}, "top_logprobs", "requires logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
    ({"presence_penalty": 3}, "presence_penalty", "between -2 and 2"),
    ({"ignore_eos": "yes"}, "ignore_eos", "boolean"),
    ({"top_k": 2.5}, "top_k", "integer"),
    ({"max_tokens": 2, "min_tokens": 3}, "min_tokens", "max_tokens"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids", "vocab size"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"5": "x"}}, "logit_bias", "map token ids to numbers"),
    ({"logit_bias": {"five": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"49152": 1}}, "logit_bias", "vocab size 49152"),
    ({"logit_bias": [5]}, "logit_bias", "map token ids to numbers"),
    ({"tools": [{"type": "function"}]}, "tools", "each tool must be"),
    ({"tools": []}, "tools", "non-empty list"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "needs a name"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "naming"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice", "no room for response_format"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_object or json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format", "with a name"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "invalid json_schema"),
    ({"user": 5}, "user", "string"),
]
BAD_COMPLETION: list[tuple[dict[str, Any], str, str]] = [
    ({"prompt": []}, "prompt", "must be"),
    ({"prompt": None}, "prompt", "must be"),
    ({"prompt": [1, "a"]}, "prompt", "must be"),
    ({"prompt": [[]]}, "prompt", "must not be empty"),
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({"prompt": [49152]}, "prompt", "[0, 49152)"),
    ({"prompt": "word " * 3000}, "prompt", "context length"),
    ({"max_tokens": 2048}, "max_tokens", "context length"),
    ({"logprobs": 21}, "logprobs", "between 0 and 20"),
    ({"logprobs": True}, "logprobs", "integer"),
    ({"echo": True, "logprobs": 1, "stream": True}, "echo", "streaming"),
    ({"best_of": 3}, "best_of", "not supported"),
    ({"suffix": "x"}, "suffix", "not supported"),
    ({"logit_bias": {"-3": 1}}, "logit_bias", ">= 0"),
    ({"model": "gpt-4"}, "model", "does not exist"),
]


@pytest.mark.parametrize(("change", "param", "fragment"), BAD_CHAT, ids=lambda v: str(v)[:40])
def test_bad_chat_request(tok, change, param, fragment):
    async def scenario(api, fake):
        with pytest.raises(openai.BadRequestError) as err:
            await api.chat.completions.create(model=MODEL, messages=USER, extra_body=change)
        assert_error(err.value, param, fragment)

    assert run(tok, scenario).requests == []


@pytest.mark.parametrize(("change", "param", "fragment"), BAD_COMPLETION, ids=lambda v: str(v)[:40])
def test_bad_completion_request(tok, change, param, fragment):
    async def scenario(api, fake):
        with pytest.raises(openai.BadRequestError) as err:
            await api.completions.create(model=MODEL, prompt=PROMPT, extra_body=change)
        assert_error(err.value, param, fragment)

    assert run(tok, scenario).requests == []


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_answers_with_its_call(tok, stream):
    choice = {"type": "function", "function": {"name": "get_weather"}}

    async def scenario(api, fake):
        fake.reply_for = lambda _: '{"city": "Paris"}'
        reply = await api.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, tool_choice=choice, stream=stream
        )
        if stream:
            chunks = [c async for c in reply]
            calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
            assert len(calls) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
            call = calls[0][0]
            assert call.index == 0
        else:
            message = reply.choices[0].message
            assert message.content is None and reply.choices[0].finish_reason == "tool_calls"
            (call,) = message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}

    fake = run(tok, scenario)
    assert json.loads(fake.requests[0].params.json_schema) == WEATHER


def test_a_required_tool_choice_picks_among_the_tools(tok):
    async def scenario(api, fake):
        fake.reply_for = lambda _: '{"name": "get_time", "arguments": {}}'
        reply = await api.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, tool_choice="required"
        )
        (call,) = reply.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {})
        assert reply.choices[0].finish_reason == "tool_calls"

    fake = run(tok, scenario)
    names = [a["properties"]["name"]["const"]
             for a in json.loads(fake.requests[0].params.json_schema)["anyOf"]]
    assert names == ["get_weather", "get_time"]


def test_tools_with_auto_leave_the_answer_to_the_model(tok):
    async def scenario(api, fake):
        reply = await api.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
        assert reply.choices[0].message.content == REPLY
        assert reply.choices[0].finish_reason == "stop"

    assert run(tok, scenario).requests[0].params.json_schema is None


def test_constraints_are_refused_with_the_grammar_backend_off(tok):
    async def scenario(api, fake):
        fake.grammar_backend = "none"
        form = {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}
        with pytest.raises(openai.BadRequestError) as err:
            await api.chat.completions.create(model=MODEL, messages=USER, response_format=form)
        assert_error(err.value, "response_format", "grammar_backend none")
        with pytest.raises(openai.BadRequestError) as err:
            await api.completions.create(model=MODEL, prompt=PROMPT, extra_body={"regex": "a"})
        assert_error(err.value, "regex", "grammar_backend none")

    assert run(tok, scenario).requests == []


def assert_error(err: openai.APIStatusError, param: str, fragment: str) -> None:
    assert err.status_code == 400
    assert set(err.body) == {"message", "type", "param", "code"}
    assert err.body["type"] == "invalid_request_error" and err.body["code"] is None
    assert err.param == param
    assert fragment in err.body["message"]


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_malformed_body(tok, body):
    async def scenario(api, fake):
        async with aiohttp.ClientSession() as http:
            for path in ("/completions", "/chat/completions"):
                async with http.post(str(api.base_url) + path.lstrip("/"), data=body) as resp:
                    assert resp.status == 400
                    error = (await resp.json())["error"]
        assert error["type"] == "invalid_request_error" and error["param"] is None
        assert "JSON" in error["message"]

    assert run(tok, scenario).requests == []


def test_generation_error_keeps_its_status(tok):
    async def scenario(api, fake):
        fake.error = GenerationError("no engine serves the model", 503)
        with pytest.raises(openai.InternalServerError) as err:
            await api.chat.completions.create(model=MODEL, messages=USER)
        assert err.value.status_code == 503 and err.value.body["type"] == "server_error"
        assert err.value.body["message"] == "no engine serves the model"
        fake.error = GenerationError("too many requests", 429)
        with pytest.raises(openai.RateLimitError):
            await api.completions.create(model=MODEL, prompt=PROMPT, stream=True)

    run(tok, scenario)


def test_aborted_request_is_an_error(tok):
    async def scenario(api, fake):
        fake.abort_message = "the engine shut down"
        with pytest.raises(openai.InternalServerError) as err:
            await api.completions.create(model=MODEL, prompt=PROMPT)
        assert err.value.body["message"] == "the engine shut down"
        with pytest.raises(openai.InternalServerError):
            await api.completions.create(model=MODEL, prompt=PROMPT, stream=True)

    run(tok, scenario)


def test_abort_mid_stream_is_an_error_event(tok):
    async def scenario(api, fake):
        fake.abort_message, fake.abort_after = "the engine shut down", 2
        stream = await api.chat.completions.create(model=MODEL, messages=USER, n=2, stream=True)
        contents = []
        with pytest.raises(openai.APIError, match="the engine shut down"):
            async for chunk in stream:
                contents += [c.delta.content for c in chunk.choices]
        assert len(contents) > 2  # the error came after output had been sent

    run(tok, scenario)


# ------------------------------------------------------------------------------- streaming


def test_sse_wire_format(tok):
    async def scenario(api, fake):
        body = {"model": MODEL, "prompt": PROMPT, "stream": True, "max_tokens": 4}
        async with (
            aiohttp.ClientSession() as http,
            http.post(str(api.base_url) + "completions", json=body) as resp,
        ):
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            raw = (await resp.read()).decode()
        events = raw.split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""]
        for event in events[:-2]:
            assert event.startswith("data: ") and "\n" not in event
            json.loads(event[len("data: ") :])

    run(tok, scenario)


@pytest.mark.parametrize("n", [1, 2])
def test_disconnect_mid_stream_closes_the_streams(tok, n):
    async def scenario(api, fake):
        fake.hold_after = 2
        stream = await api.chat.completions.create(model=MODEL, messages=USER, n=n, stream=True)
        # Each choice sends its role, then two tokens, then stalls.
        chunks = dict.fromkeys(range(n), 0)
        async for chunk in stream:
            for choice in chunk.choices:
                chunks[choice.index] += 1
            if all(count == 3 for count in chunks.values()):
                break
        await stream.close()
        await asyncio.wait_for(wait_closed(fake, n), timeout=10)

    fake = run(tok, scenario)
    assert sorted(fake.closed) == sorted(r.rid for r in fake.requests) and fake.finished == []


async def wait_closed(fake: FakeGenerationClient, n: int) -> None:
    while len(fake.closed) < n:
        fake.closed_event.clear()
        if len(fake.closed) < n:
            await fake.closed_event.wait()


# aiohttp cancels the handler itself only when the server asks for it.
@pytest.mark.parametrize("handler_cancellation", [False, True])
def test_disconnect_while_waiting_closes_the_stream(tok, handler_cancellation):
    async def scenario(api, fake):
        fake.hold_after = 0
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": PROMPT}
            request = asyncio.ensure_future(http.post(str(api.base_url) + "completions", json=body))
            await fake.held.wait()
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)
        await asyncio.wait_for(fake.closed_event.wait(), timeout=10)

    fake = run(tok, scenario, handler_cancellation)
    assert fake.closed == [fake.requests[0].rid]


def test_unknown_fields_are_ignored(tok):
    async def scenario(api, fake):
        out = await api.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=2, extra_body={"something_new": {"x": 1}}
        )
        assert out.choices[0].finish_reason == "length"

    run(tok, scenario)


def test_eos_token_id_is_a_stop(tok):
    async def scenario(api, fake):
        out = await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=50)
        assert out.usage.completion_tokens == len(reply_ids(tok)) + 1
        assert out.choices[0].finish_reason == "stop"

    fake = run(tok, scenario)
    assert fake.requests[0].params.max_new_tokens == 50 and EOS_ID in tok.eos_token_ids


def test_oversized_body_is_an_openai_error(tok):
    async def scenario(api, fake):
        body = {"model": MODEL, "prompt": "x" * (2 << 20)}
        async with (
            aiohttp.ClientSession() as http,
            http.post(str(api.base_url) + "completions", json=body) as resp,
        ):
            assert resp.status == 413
            error = (await resp.json())["error"]
        assert error["type"] == "invalid_request_error" and "size" in error["message"]

    assert run(tok, scenario).requests == []
