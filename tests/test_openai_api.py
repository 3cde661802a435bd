"""The OpenAI routes' answers behind a real aiohttp server, driven by the real `openai`
client, with a fake mesh (tests/fake_generation.py) that records what reached it: models,
chat and completions. Refusals, tool choices and streams: test_openai_refusals.py."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from fake_generation import (
    PROMPT_LOGPROB,
    REPLY,
    host_part,
    output_logprob,
)
from openai_serving import MODEL, PROMPT, USER, chat_ids, reply_ids, run

from radixmesh.core.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_path(None)


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
                "spaces_between_special_tokens": False,
            },
        )
        await api.chat.completions.create(model=MODEL, messages=USER,
                                          logit_bias={"50": -100, "7": 3})

    fake = run(tok, scenario)
    assert fake.requests[0].params.stop == ["42"]
    params = fake.requests[1].params
    assert params.stop == ["a", "b"] and params.stop_token_ids == [7, 9]
    assert (params.top_k, params.min_p, params.repetition_penalty) == (5, 0.1, 1.1)
    assert (params.min_new_tokens, params.max_new_tokens) == (2, 12)
    assert params.ignore_eos and params.no_stop_trim and not params.skip_special_tokens
    assert not params.spaces_between_special_tokens
    assert fake.requests[2].params.logit_bias == {50: -100.0, 7: 3.0}


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
