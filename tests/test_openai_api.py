"""The OpenAI routes behind a real aiohttp server, driven by the real `openai` client, with a
fake mesh (tests/fake_generation.py) that records what reached it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from fake_generation import (
    EOS_ID,
    PROMPT_LOGPROB,
    REPLY,
    FakeGenerationClient,
    host_part,
    output_logprob,
)
from openai import AsyncOpenAI

from radixmesh.core.tokenizer import Tokenizer
from radixmesh.services.tokenizer.generation import GenerationError
from radixmesh.services.tokenizer.openai_api import add_openai_routes

MODEL = "fake/SmolLM2"
USER = [{"role": "user", "content": "What is the answer?"}]
PROMPT = "The question is"
Scenario = Callable[[AsyncOpenAI, FakeGenerationClient], Awaitable[None]]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_path(None)


@contextlib.asynccontextmanager
async def serving(
    fake: FakeGenerationClient, handler_cancellation: bool = False
) -> AsyncIterator[str]:
    """The routes on a free loopback port; yields the API's base URL."""
    app = web.Application()
    add_openai_routes(app, fake)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=handler_cancellation)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    finally:
        await runner.cleanup()


def run(
    tok: Tokenizer, scenario: Scenario, handler_cancellation: bool = False
) -> FakeGenerationClient:
    """Serve a fresh fake mesh, run `scenario` against it, return the fake for checks."""
    fake = FakeGenerationClient(tok, MODEL)

    async def main() -> None:
        async with serving(fake, handler_cancellation) as base_url:
            api = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
            try:
                await scenario(api, fake)
            finally:
                await api.close()

    asyncio.run(main())
    return fake


def reply_ids(tok: Tokenizer) -> list[int]:
    return tok.encode(REPLY)


def chat_ids(tok: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


# ---------------------------------------------------------------------------------- models


def test_models(tok):
    async def scenario(api, fake):
        models = await api.models.list()
        assert [m.id for m in models.data] == [MODEL]
        assert (await api.models.retrieve(MODEL)).id == MODEL
        with pytest.raises(openai.NotFoundError) as err:
            await api.models.retrieve("other")
        assert err.value.param == "model" and MODEL in err.value.body["message"]

    run(tok, scenario)


# ------------------------------------------------------------------------------------ chat


def test_chat_completion(tok):
    async def scenario(api, fake):
        out = await api.chat.completions.create(model=MODEL, messages=USER)
        assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
        assert out.model == MODEL and out.created > 0
        [choice] = out.choices
        assert choice.index == 0 and choice.finish_reason == "stop"
        assert choice.message.role == "assistant" and choice.message.content == REPLY
        assert choice.logprobs is None
        prompt = chat_ids(tok, USER)
        assert out.usage.prompt_tokens == len(prompt)
        assert out.usage.completion_tokens == len(reply_ids(tok)) + 1  # and the EOS
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
        assert out.usage.prompt_tokens_details.cached_tokens == 0

    fake = run(tok, scenario)
    [request] = fake.requests
    # The model's template adds its default system prompt and the generation prompt.
    text = tok.decode(request.input_ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is the answer?<|im_end|>\n<|im_start|>assistant\n")
    assert request.input_ids == chat_ids(tok, USER)
    # Without max_tokens the output may fill the rest of the context.
    assert request.params.max_new_tokens == 2048 - len(request.input_ids)
    assert request.rid.startswith("chatcmpl-") and fake.finished == [request.rid]


def test_chat_messages_roles_and_parts(tok):
    messages: list[dict[str, Any]] = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
        },
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
    ]

    async def scenario(api, fake):
        await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)

    fake = run(tok, scenario)
    expected = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "one\ntwo"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
    ]
    assert fake.requests[0].input_ids == chat_ids(tok, expected)


def test_chat_stream_with_usage(tok):
    async def scenario(api, fake):
        stream = await api.chat.completions.create(
            model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
        assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
        first, *middle, finish, last = chunks
        assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
        assert "".join(c.choices[0].delta.content for c in middle) == REPLY
        assert all(c.choices[0].finish_reason is None and c.usage is None for c in middle)
        assert finish.choices[0].finish_reason == "stop"
        assert finish.choices[0].delta.content is None
        assert last.choices == [] and last.usage.completion_tokens == len(reply_ids(tok)) + 1
        assert last.usage.prompt_tokens == len(chat_ids(tok, USER))

    run(tok, scenario)


def test_chat_n2_and_sampling_fields(tok):
    async def scenario(api, fake):
        fake.reply_for = lambda r: f" seed {r.params.seed}"
        out = await api.chat.completions.create(
            model=MODEL,
            messages=USER,
            n=2,
            seed=7,
            temperature=0.5,
            top_p=0.9,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            max_completion_tokens=10,
            stop=["\n\n", "###"],
            user="someone",
        )
        assert [(c.index, c.message.content) for c in out.choices] == [
            (0, " seed 7"),
            (1, " seed 8"),
        ]
        assert out.usage.prompt_tokens == len(chat_ids(tok, USER))  # once, not per choice
        assert out.usage.completion_tokens == sum(len(tok.encode(f" seed {s}")) + 1 for s in (7, 8))

    fake = run(tok, scenario)
    first, second = fake.requests
    assert first.params.seed == 7 and second.params.seed == 8
    assert first.rid != second.rid
    for request in fake.requests:
        params = request.params
        assert (params.temperature, params.top_p, params.max_new_tokens) == (0.5, 0.9, 10)
        assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
        assert params.stop == ["\n\n", "###"]


def test_chat_stream_n2_runs_concurrently(tok):
    async def scenario(api, fake):
        stream = await api.chat.completions.create(model=MODEL, messages=USER, n=2, stream=True)
        text = {0: "", 1: ""}
        finished = set()
        async for chunk in stream:
            for choice in chunk.choices:
                text[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    finished.add(choice.index)
        assert text == {0: REPLY, 1: REPLY} and finished == {0, 1}

    run(tok, scenario)


def test_chat_logprobs(tok):
    ids = reply_ids(tok)

    async def scenario(api, fake):
        out = await api.chat.completions.create(
            model=MODEL, messages=USER, logprobs=True, top_logprobs=2
        )
        content = out.choices[0].logprobs.content
        assert [c.token for c in content] == [tok.decode([i]) for i in ids] + ["<|im_end|>"]
        assert [c.logprob for c in content] == pytest.approx(
            [output_logprob(k) for k in range(len(ids) + 1)]
        )
        assert content[0].bytes == list(tok.decode([ids[0]]).encode())
        assert [len(c.top_logprobs) for c in content] == [2] * len(content)
        assert content[0].top_logprobs[1].token == tok.decode([ids[0] + 1])
        assert content[0].top_logprobs[1].logprob == pytest.approx(output_logprob(0) - 1)

        stream = await api.chat.completions.create(
            model=MODEL, messages=USER, logprobs=True, top_logprobs=2, stream=True
        )
        streamed = [
            entry
            async for chunk in stream
            for choice in chunk.choices
            if choice.logprobs
            for entry in choice.logprobs.content
        ]
        assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]

        plain = await api.chat.completions.create(model=MODEL, messages=USER, logprobs=True)
        assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)

    fake = run(tok, scenario)
    assert fake.requests[0].logprobs.return_logprob
    assert fake.requests[0].logprobs.top_logprobs_num == 2
    assert fake.requests[0].logprobs.logprob_start_len == -1


def test_cached_tokens_in_usage(tok):
    async def scenario(api, fake):
        first = await api.chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
        again = await api.chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
        # Part of the hit came back from the host tier: usage still counts every tier, and
        # says nothing more.
        hit = first.usage.prompt_tokens - 1
        assert host_part(hit) > 0
        raw = await api.chat.completions.with_raw_response.create(
            model=MODEL, messages=USER, max_tokens=3
        )
        assert json.loads(raw.text)["usage"]["prompt_tokens_details"] == {"cached_tokens": hit}

    run(tok, scenario)


# ----------------------------------------------------------------------------- completions


def test_completion(tok):
    async def scenario(api, fake):
        out = await api.completions.create(model=MODEL, prompt=PROMPT)
        assert out.id.startswith("cmpl-") and out.object == "text_completion"
        [choice] = out.choices
        assert (choice.index, choice.text, choice.finish_reason) == (0, REPLY, "stop")
        assert out.usage.prompt_tokens == len(tok.encode(PROMPT))

        cut = await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
        assert cut.choices[0].text == tok.decode(reply_ids(tok)[:3])
        assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3

    fake = run(tok, scenario)
    assert fake.requests[0].params.max_new_tokens == 16  # OpenAI's default
    assert fake.requests[0].input_ids == tok.encode(PROMPT)


def test_completion_prompt_forms_and_n(tok):
    ids = tok.encode(PROMPT)

    async def scenario(api, fake):
        fake.reply_for = lambda r: f" {len(r.input_ids)}/{r.params.seed}"
        out = await api.completions.create(
            model=MODEL, prompt=[ids, ids[:2], ids[:1]], n=2, seed=3, max_tokens=5
        )
        texts = [(c.index, c.text) for c in out.choices]
        n = len(ids)
        assert texts == [
            (0, f" {n}/3"),
            (1, f" {n}/4"),
            (2, " 2/3"),
            (3, " 2/4"),
            (4, " 1/3"),
            (5, " 1/4"),
        ]
        assert out.usage.prompt_tokens == n + 2 + 1

        for prompt in (PROMPT, [PROMPT], ids, [ids]):
            single = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
            assert single.usage.prompt_tokens == n

    fake = run(tok, scenario)
    assert [r.input_ids for r in fake.requests[:6]] == [
        ids,
        ids,
        ids[:2],
        ids[:2],
        ids[:1],
        ids[:1],
    ]
    assert len({r.rid for r in fake.requests}) == len(fake.requests)


def test_completion_stream_with_usage(tok):
    async def scenario(api, fake):
        stream = await api.completions.create(
            model=MODEL, prompt=PROMPT, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        *deltas, finish, last = chunks
        assert "".join(c.choices[0].text for c in deltas) == REPLY
        assert all(c.choices[0].finish_reason is None for c in deltas)
        assert finish.choices[0].finish_reason == "stop" and finish.choices[0].text == ""
        assert last.choices == [] and last.usage.prompt_tokens == len(tok.encode(PROMPT))
        assert last.usage.completion_tokens == len(reply_ids(tok)) + 1

        quiet = await api.completions.create(model=MODEL, prompt=PROMPT, stream=True)
        assert all(c.choices and c.usage is None for c in [c async for c in quiet])

    run(tok, scenario)


def test_stop_strings_and_sglang_fields_pass_through(tok):
    async def scenario(api, fake):
        out = await api.completions.create(model=MODEL, prompt=PROMPT, stop="42")
        assert out.choices[0].text == " The answer is " and out.choices[0].finish_reason == "stop"
        await api.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            stop=["a", "b"],
            extra_body={
                "top_k": 5,
                "min_p": 0.1,
                "repetition_penalty": 1.1,
                "min_tokens": 2,
                "ignore_eos": True,
                "skip_special_tokens": False,
                "no_stop_trim": True,
                "stop_token_ids": [7, 9],
            },
        )

    fake = run(tok, scenario)
    assert fake.requests[0].params.stop == ["42"]
    params = fake.requests[1].params
    assert params.stop == ["a", "b"] and params.stop_token_ids == [7, 9]
    assert (params.top_k, params.min_p, params.repetition_penalty) == (5, 0.1, 1.1)
    assert (params.min_new_tokens, params.max_new_tokens) == (2, 12)
    assert params.ignore_eos and params.no_stop_trim and not params.skip_special_tokens


def test_completion_logprobs(tok):
    ids = reply_ids(tok)[:4]
    texts = [tok.decode([i]) for i in ids]

    async def scenario(api, fake):
        out = await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=2)
        logprobs = out.choices[0].logprobs
        assert logprobs.tokens == texts
        assert logprobs.token_logprobs == pytest.approx([output_logprob(k) for k in range(4)])
        offsets = [sum(len(t) for t in texts[:k]) for k in range(4)]
        assert logprobs.text_offset == offsets
        first = logprobs.top_logprobs[0]
        assert first == pytest.approx(
            {texts[0]: output_logprob(0), tok.decode([ids[0] + 1]): output_logprob(0) - 1}
        )
        assert [len(top) for top in logprobs.top_logprobs] == [2] * 4

        stream = await api.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=2, stream=True
        )
        parts = [c.choices[0].logprobs async for c in stream if c.choices[0].logprobs]
        assert sum((p.tokens for p in parts), []) == logprobs.tokens
        assert sum((p.text_offset for p in parts), []) == logprobs.text_offset
        assert sum((p.top_logprobs for p in parts), []) == logprobs.top_logprobs

        zero = await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=0)
        assert zero.choices[0].logprobs.top_logprobs == [{texts[0]: pytest.approx(-0.1)}]

    fake = run(tok, scenario)
    assert fake.requests[0].logprobs.top_logprobs_num == 2
    assert fake.requests[0].logprobs.logprob_start_len == -1


def test_completion_echo(tok):
    prompt_ids = tok.encode(PROMPT)

    async def scenario(api, fake):
        out = await api.completions.create(
            model=MODEL, prompt=PROMPT, echo=True, max_tokens=2, logprobs=1
        )
        choice = out.choices[0]
        assert choice.text == PROMPT + tok.decode(reply_ids(tok)[:2])
        logprobs = choice.logprobs
        prompt_texts = [tok.decode([i]) for i in prompt_ids]
        assert logprobs.tokens[: len(prompt_ids)] == prompt_texts
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert logprobs.token_logprobs[1:3] == [PROMPT_LOGPROB] * 2
        assert len(logprobs.tokens) == len(prompt_ids) + 2
        assert logprobs.text_offset[len(prompt_ids)] == len(PROMPT)

        stream = await api.completions.create(
            model=MODEL, prompt=[prompt_ids], echo=True, max_tokens=2, stream=True
        )
        texts = [c.choices[0].text async for c in stream]
        assert texts[0] == PROMPT and "".join(texts) == choice.text

    fake = run(tok, scenario)
    assert fake.requests[0].logprobs.logprob_start_len == 0


# ---------------------------------------------------------------------------------- errors

BAD_CHAT: list[tuple[dict[str, Any], str, str]] = [
    ({"messages": []}, "messages", "must not be empty"),
    ({"messages": "hi"}, "messages", "must be a list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "robot"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, "messages[0].role", "tool"),
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
    ({"logit_bias": {"5": 1}}, "logit_bias", "not supported"),
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
    ({"regex": "(unclosed"}, "regex", "invalid regex"),
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
