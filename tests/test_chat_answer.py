"""Chat answers split by the server's parsers, through the real `openai` client over a fake
mesh (tests/fake_generation.py): tool calls in auto mode (parsed whole and streamed, the
constraint that keeps a started call valid), reasoning_content, chat_template_kwargs, the
constraint moved past the reasoning, and the refusals."""

from __future__ import annotations

import json

import openai
import pytest
from openai_serving import MODEL, USER, run

from radixmesh.core import grammar
from radixmesh.core.tokenizer import Tokenizer

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REASONED = "<think>\nThe user wants the answer.\n</think>\n\nIt is 42."


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_path(None)


async def _streamed(api, **kwargs) -> tuple[list, dict]:
    """A streamed chat's chunks, and its deltas gathered: content, reasoning and calls."""
    chunks = [c async for c in await api.chat.completions.create(model=MODEL, stream=True,
                                                                  **kwargs)]
    out: dict = {"content": "", "reasoning": "", "calls": {}, "order": []}
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        out["content"] += delta.content or ""
        out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            entry = out["calls"].setdefault(call.index, {"name": None, "arguments": ""})
            if call.function.name is not None:
                assert entry["name"] is None and entry["arguments"] == ""  # the name first
                entry["name"], entry["id"] = call.function.name, call.id
            out["order"].append(call.index)
            entry["arguments"] += call.function.arguments or ""
    out["finish"] = chunks[-1].choices[0].finish_reason
    return chunks, out


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_come_back_parsed(tok, stream):
    async def scenario(api, fake):
        fake.reply_for = lambda _: f"Let me look.\n{CALL}\n{CALL.replace('Paris', 'Rome')}"
        if stream:
            chunks, out = await _streamed(api, messages=USER, tools=TOOLS)
            assert out["content"].strip() == "Let me look."
            calls = [out["calls"][k] for k in sorted(out["calls"])]
            # Arguments arrive in pieces as the model writes them.
            assert out["order"].count(0) > 2
            assert out["finish"] == "tool_calls"
        else:
            reply = await api.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
            message = reply.choices[0].message
            assert message.content == "Let me look."
            assert reply.choices[0].finish_reason == "tool_calls"
            calls = [{"name": c.function.name, "arguments": c.function.arguments, "id": c.id}
                     for c in message.tool_calls]
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
        assert len({c["id"] for c in calls}) == 2

    fake = run(tok, scenario, tool_call_parser="qwen25")
    params = fake.requests[0].params
    assert params.json_schema is None
    tag = json.loads(params.structural_tag)["format"]
    assert tag["type"] == "triggered_tags" and tag["triggers"] == ["<tool_call>"]
    assert [t["content"]["json_schema"] for t in tag["tags"]] == [
        WEATHER, {"type": "object", "properties": {}, "additionalProperties": False}]
    assert tag["stop_after_first"] is False


def test_a_started_call_is_held_to_its_tools_schema(tok):
    """The constraint the engine gets accepts a valid call and refuses an invalid one."""
    async def scenario(api, fake):
        await api.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                          parallel_tool_calls=False)

    fake = run(tok, scenario, tool_call_parser="qwen25")
    text = fake.requests[0].params.structural_tag
    assert json.loads(text)["format"]["stop_after_first"] is True
    import xgrammar

    from radixmesh.engine.model.grammar_mask import tokenizer_info

    compiler = xgrammar.GrammarCompiler(tokenizer_info(tok, tok.vocab_size, tok.eos_token_ids))
    compiled = compiler.compile_structural_tag(grammar.structural_tag(text))

    def accepts(answer: str) -> bool:
        matcher = xgrammar.GrammarMatcher(compiled)
        return all(matcher.accept_token(t) for t in tok.encode(answer))

    assert accepts(f"Sure. {CALL}")
    assert not accepts(CALL.replace('"city"', '"town"'))
    assert not accepts(CALL.replace("get_weather", "get_news"))
    assert not accepts(f"{CALL} and more")  # parallel_tool_calls false: one call, then the end


def test_text_without_a_call_stays_content(tok):
    async def scenario(api, fake):
        fake.reply_for = lambda _: "I use <tool_call> tags when needed."
        reply = await api.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
        assert reply.choices[0].message.content == "I use <tool_call> tags when needed."
        assert reply.choices[0].message.tool_calls is None
        assert reply.choices[0].finish_reason == "stop"
        _, out = await _streamed(api, messages=USER, tools=TOOLS)
        assert out["content"] == "I use <tool_call> tags when needed." and not out["calls"]

    run(tok, scenario, tool_call_parser="qwen25")


def test_tool_choice_none_neither_constrains_nor_parses(tok):
    async def scenario(api, fake):
        fake.reply_for = lambda _: CALL
        reply = await api.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                                  tool_choice="none")
        assert reply.choices[0].message.content == CALL

    assert run(tok, scenario, tool_call_parser="qwen25").requests[0].params.grammar is None


def test_a_forced_call_is_parsed_after_the_reasoning(tok):
    choice = {"type": "function", "function": {"name": "get_weather"}}

    async def scenario(api, fake):
        fake.reply_for = lambda _: '<think>\nParis, surely.\n</think>\n\n{"city": "Paris"}'
        reply = await api.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                                  tool_choice=choice)
        message = reply.choices[0].message
        assert message.reasoning_content == "Paris, surely."
        (call,) = message.tool_calls
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        _, out = await _streamed(api, messages=USER, tools=TOOLS, tool_choice=choice)
        assert out["reasoning"] == "Paris, surely." and out["finish"] == "tool_calls"
        assert json.loads(out["calls"][0]["arguments"]) == {"city": "Paris"}

    fake = run(tok, scenario, reasoning_parser="qwen3")
    form = json.loads(fake.requests[0].params.structural_tag)["format"]
    assert form["type"] == "sequence"
    thinking, answer = form["elements"]
    assert thinking["type"] == "optional"  # qwen3 may answer without thinking
    block = thinking["content"]["elements"][0]
    assert (block["begin"], block["end"]) == ("<think>", "</think>")
    assert answer["json_schema"] == WEATHER


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_comes_back_apart(tok, stream):
    async def scenario(api, fake):
        fake.reply_for = lambda _: REASONED
        if stream:
            chunks, out = await _streamed(api, messages=USER)
            reasoning, content = out["reasoning"], out["content"]
            kinds = [("r" if getattr(c.choices[0].delta, "reasoning_content", None) else "c")
                     for c in chunks if c.choices and (c.choices[0].delta.content
                                                       or getattr(c.choices[0].delta,
                                                                  "reasoning_content", None))]
            assert kinds == sorted(kinds, reverse=True) and "r" in kinds  # thinking first
        else:
            reply = await api.chat.completions.create(model=MODEL, messages=USER)
            message = reply.choices[0].message
            reasoning, content = message.reasoning_content, message.content
        assert (reasoning, content) == ("The user wants the answer.", "It is 42.")

    run(tok, scenario, reasoning_parser="qwen3")


def test_thinking_off_and_separate_reasoning_off_leave_the_text_whole(tok):
    async def scenario(api, fake):
        fake.reply_for = lambda _: REASONED
        for extra in ({"chat_template_kwargs": {"enable_thinking": False}},
                      {"separate_reasoning": False}):
            reply = await api.chat.completions.create(model=MODEL, messages=USER,
                                                      extra_body=extra)
            assert reply.choices[0].message.content == REASONED

    run(tok, scenario, reasoning_parser="qwen3")


def test_chat_template_kwargs_reach_the_template(tok, monkeypatch):
    seen: list[dict] = []
    render = Tokenizer.apply_chat_template

    def recording(self, messages, add_generation_prompt=True, **kwargs):
        seen.append(kwargs)
        return render(self, messages, add_generation_prompt, **kwargs)

    monkeypatch.setattr(Tokenizer, "apply_chat_template", recording)

    async def scenario(api, fake):
        await api.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS,
            extra_body={"chat_template_kwargs": {"enable_thinking": False, "x": 1}})

    run(tok, scenario)
    assert seen == [{"enable_thinking": False, "x": 1, "tools": TOOLS}]


def test_a_json_answer_is_constrained_after_the_thinking(tok):
    form = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}

    async def scenario(api, fake):
        fake.reply_for = lambda _: '<think>\nhmm\n</think>\n{"city": "Oslo"}'
        reply = await api.chat.completions.create(model=MODEL, messages=USER,
                                                  response_format=form)
        assert reply.choices[0].message.content == '{"city": "Oslo"}'
        # Thinking off: the constraint is the plain schema again.
        await api.chat.completions.create(
            model=MODEL, messages=USER, response_format=form,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})

    fake = run(tok, scenario, reasoning_parser="qwen3")
    first, second = (r.params for r in fake.requests)
    assert first.json_schema is None and first.structural_tag is not None
    assert json.loads(second.json_schema) == WEATHER and second.structural_tag is None


def _matcher(tok, structural_tag: str):
    """Whether the engine's constraint takes a whole answer (its tokens, then the end)."""
    import xgrammar

    from radixmesh.engine.model.grammar_mask import tokenizer_info

    compiler = xgrammar.GrammarCompiler(tokenizer_info(tok, tok.vocab_size, tok.eos_token_ids))
    compiled = compiler.compile_structural_tag(grammar.structural_tag(structural_tag))

    def takes(answer: str) -> bool:
        matcher = xgrammar.GrammarMatcher(compiled)
        ids = [*tok.encode(answer, add_special_tokens=False), tok.eos_token_ids[0]]
        return all(matcher.accept_token(t) for t in ids) and matcher.is_terminated()

    return takes


# Each kind, what turns its thinking on, and whether the model opens the block itself.
REASONING_KINDS = [
    ("qwen3", {}, True),
    ("qwen3-thinking", {}, False),
    ("deepseek-r1", {}, False),
    ("deepseek-v3", {"thinking": True}, False),
]


@pytest.mark.parametrize(("kind", "switch", "model_opens"), REASONING_KINDS)
def test_thinking_is_optional_only_where_the_model_opens_the_block(tok, kind, switch,
                                                                   model_opens):
    """A JSON answer and an auto-mode tool call after the reasoning: where the model writes
    `<think>` itself (qwen3) it may answer at once, and the answer is content or a call;
    where the template opened the block the constraint wants it closed first."""
    form = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    direct = '{"city": "Oslo"}'
    opened = "<think>\nhmm\n</think>\n" if model_opens else "hmm\n</think>\n"

    async def scenario(api, fake):
        fake.reply_for = lambda _: direct if model_opens else opened + direct
        reply = await api.chat.completions.create(
            model=MODEL, messages=USER, response_format=form,
            extra_body={"chat_template_kwargs": switch})
        message = reply.choices[0].message
        assert message.content == direct
        assert getattr(message, "reasoning_content", None) == (None if model_opens else "hmm")
        fake.reply_for = lambda _: CALL if model_opens else opened + CALL
        reply = await api.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, extra_body={"chat_template_kwargs": switch})
        (call,) = reply.choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert reply.choices[0].message.content in (None, "")

    fake = run(tok, scenario, tool_call_parser="qwen25", reasoning_parser=kind)
    as_json, as_call = (_matcher(tok, r.params.structural_tag) for r in fake.requests)
    assert as_json(opened + direct) and as_call(opened + CALL)
    assert as_json(direct) == model_opens and as_call(CALL) == model_opens
    assert not as_json(opened + '{"town": "Oslo"}')


def test_only_a_templates_blanks_come_between_the_thinking_and_the_answer(tok):
    """After `</think>`, what chat templates write there ("\n\n" at most) and no other
    blank, so a small model cannot fill its budget with them; without a block the answer
    starts at once, so the content is the answer exactly."""
    form = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}

    async def scenario(api, fake):
        await api.chat.completions.create(model=MODEL, messages=USER, response_format=form)

    fake = run(tok, scenario, reasoning_parser="qwen3")
    takes = _matcher(tok, fake.requests[0].params.structural_tag)
    answer = '{"city": "Oslo"}'
    assert takes(answer)
    for lead in ("", "\n", "\n\n", " "):
        assert takes(f"<think>\nhmm\n</think>{lead}{answer}")
    for lead in ("\n\n\n", "\u205f", "\u3000", "\t"):
        assert not takes(f"<think>hmm</think>{lead}{answer}")
    assert not takes("\n" + answer) and not takes("\u205f" + answer)


def test_a_structural_tags_json_takes_one_blank_between_tokens(tok):
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<a>", "end": "</a>",
        "content": {"type": "json_schema", "json_schema": WEATHER}}}
    loose = json.loads(json.dumps(tag))
    loose["format"]["content"]["max_whitespace_cnt"] = 3

    async def scenario(api, fake):
        for given in (tag, loose):
            await api.chat.completions.create(model=MODEL, messages=USER,
                                              extra_body={"structural_tag": json.dumps(given)})

    fake = run(tok, scenario)
    bounded, own = (_matcher(tok, r.params.structural_tag) for r in fake.requests)
    assert bounded('<a>{"city": "Oslo"}</a>') and bounded('<a>{ "city" : "Oslo" }</a>')
    assert not bounded('<a>{\n\n"city": "Oslo"}</a>')
    assert own('<a>{\n\n"city": "Oslo"}</a>')  # a bound it sets itself is kept


def _allowed_after(tok, structural_tag: str, text: str) -> set[str]:
    """The texts of the tokens the engine's constraint allows after `text`'s tokens."""
    import xgrammar

    from radixmesh.engine.model.grammar_mask import tokenizer_info

    compiler = xgrammar.GrammarCompiler(tokenizer_info(tok, tok.vocab_size, tok.eos_token_ids))
    matcher = xgrammar.GrammarMatcher(compiler.compile_structural_tag(structural_tag))
    assert all(matcher.accept_token(t) for t in tok.encode(text, add_special_tokens=False))
    mask = xgrammar.allocate_token_bitmask(1, tok.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    words = mask[0].tolist()
    return {tok.raw.decode([i]) for i in range(tok.vocab_size) if words[i // 32] >> i % 32 & 1}


@pytest.mark.parametrize(("kind", "opening"), [("deepseek-r1", ""), ("qwen3", "<think>")])
def test_a_thinking_budget_closes_the_thinking(tok, kind, opening):
    """Past thinking_budget tokens only `</think>` may follow; then the answer, constrained
    or (without a constraint) free."""
    form = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    thought = " one two three four"

    async def scenario(api, fake):
        for extra in ({"response_format": form}, {}):
            await api.chat.completions.create(model=MODEL, messages=USER,
                                              extra_body={"thinking_budget": 4, **extra})

    fake = run(tok, scenario, reasoning_parser=kind)
    constrained, free = (r.params.structural_tag for r in fake.requests)
    assert len(tok.encode(thought, add_special_tokens=False)) == 4
    for tag in (constrained, free):
        assert _allowed_after(tok, tag, opening + thought) == {"<", "</"}
        assert len(_allowed_after(tok, tag, opening + " one two")) > 1000
    assert _matcher(tok, constrained)(f'{opening}{thought}</think>\n\n{{"city": "Oslo"}}')
    assert _matcher(tok, free)(f"{opening}{thought}</think>\n\nOslo, I think.")
    # A free answer after a block the model opens itself never opens another one.
    assert _matcher(tok, free)("a</think>b<think>c") == (not opening)
    assert fake.requests[1].params.json_schema is None


def test_a_thinking_budget_without_thinking_changes_nothing(tok):
    async def scenario(api, fake):
        await api.chat.completions.create(
            model=MODEL, messages=USER, extra_body={
                "thinking_budget": 4, "chat_template_kwargs": {"enable_thinking": False}})

    (request,) = run(tok, scenario, reasoning_parser="qwen3").requests
    assert request.params.grammar is None


def test_a_thinking_budget_needs_a_reasoning_parser(tok):
    async def scenario(api, fake):
        with pytest.raises(openai.BadRequestError) as err:
            await api.chat.completions.create(model=MODEL, messages=USER,
                                              extra_body={"thinking_budget": 4})
        assert err.value.param == "thinking_budget"
        assert "needs a server that parses reasoning" in err.value.body["message"]

    assert run(tok, scenario).requests == []


def test_a_conversation_with_tool_results_renders(tok, monkeypatch):
    seen: list[list[dict]] = []
    render = Tokenizer.apply_chat_template
    monkeypatch.setattr(Tokenizer, "apply_chat_template",
                        lambda self, messages, *a, **k: seen.append(messages)
                        or render(self, messages, *a, **k))
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]

    async def scenario(api, fake):
        await api.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)

    run(tok, scenario, tool_call_parser="qwen25")
    assert seen[0][1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert seen[0][2] == {"role": "tool", "content": "18 degrees", "tool_call_id": "call_1"}


@pytest.mark.parametrize(("extra", "param", "fragment"), [
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs", "must be an object"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "may not set tools"),
    ({"separate_reasoning": "yes"}, "separate_reasoning", "must be a boolean"),
    ({"thinking_budget": -1}, "thinking_budget", "must be an integer >= 0, got -1"),
    ({"thinking_budget": "8"}, "thinking_budget", "must be an integer >= 0, got '8'"),
    ({"thinking_budget": True}, "thinking_budget", "must be an integer >= 0, got True"),
    ({"parallel_tool_calls": 1, "tools": TOOLS}, "parallel_tool_calls", "must be a boolean"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "bogus"}}}]}, "tools", "parameters of tool 'f'"),
    ({"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls", "must be JSON"),
    ({"messages": [*USER, {"role": "assistant", "content": "", "tool_calls": "f"}]},
     "messages[1].tool_calls", "must be a list"),
])
def test_bad_agent_fields_are_refused(tok, extra, param, fragment):
    async def scenario(api, fake):
        body = {"messages": USER, **extra}
        known = {k: body.pop(k) for k in ("messages", "tools", "parallel_tool_calls")
                 if k in body}
        with pytest.raises(openai.BadRequestError) as err:
            await api.chat.completions.create(model=MODEL, **known, extra_body=body)
        assert err.value.param == param and fragment in err.value.body["message"]

    assert run(tok, scenario, tool_call_parser="qwen25", reasoning_parser="qwen3"
               ).requests == []
