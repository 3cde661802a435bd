"""What agent frameworks and gateways do, through `radixmesh up` on the real SmolLM2 with
the `openai` client: tool calls in auto mode in each parser's format, streamed and whole, a
started call held to its tool's schema, reasoning split from the answer, every kind of
constrained answer after the thinking under every reasoning parser, a tool's result sent
back; and interactive traffic ahead of batch jobs (priority scheduling with room for two
running requests).

SmolLM2 does not call tools by itself; shown one earlier turn that called a tool in a
format, it calls again in that format for the next question (greedy, so the same every
run). One mesh serves all formats: its tokenizer parses the qwen25 format, and a tokenizer
started beside it for each other format and each reasoning parser joins the same engine (a
front door scales on its own)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat.chat_completion import Choice
from process_helpers import running_mesh, service_process

from radixmesh.core.reasoning import HARMONY, REASONING_PARSERS, thinking_enabled
from radixmesh.launcher import Mesh
from radixmesh.mesh.nats_server import free_port

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
# The earlier turn never names a country: only the constraint makes the model write one.
CITY_COUNTRY = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
                "properties": {"city": {"type": "string"}, "country": {"type": "string"}}}
CALLS = {
    "qwen25": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "pythonic": '[get_weather(city="Paris")]',
    # gpt-oss's harmony call (its tokenizer reads it with both gpt-oss parsers); SmolLM2
    # copies it without the `<|constrain|>json` that gpt-oss itself writes.
    HARMONY: '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Paris"}<|call|>',
}
GREEDY = {"temperature": 0, "max_tokens": 60}


def tools(schema: dict) -> list[dict]:
    return [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.", "parameters": schema}}]


def conversation(fmt: str) -> list[dict]:
    """A chat whose earlier turn called get_weather in `fmt`, asking about another city."""
    return [
        {"role": "system", "content": "You are a helpful assistant. You can call "
                                      "get_weather(city) to learn the weather in a city."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": CALLS[fmt]},
        {"role": "tool", "content": "18 degrees, sunny"},
        {"role": "assistant", "content": "It is 18 degrees and sunny in Paris."},
        {"role": "user", "content": "What is the weather in Rome?"},
    ]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> Iterator[Mesh]:
    log_dir = tmp_path_factory.mktemp("agents-mesh")
    with running_mesh(log_dir, dtype="float32", max_total_tokens=8192,
                      tool_call_parser="qwen25", enable_priority_scheduling=True,
                      max_running_requests=2) as m:
        yield m


@pytest.fixture(scope="module")
def fronts(mesh: Mesh) -> Iterator[dict[str, openai.OpenAI]]:
    """An OpenAI client per tool-call format, each on a tokenizer parsing that format, and
    one per reasoning parser (named after it) on a tokenizer parsing that reasoning and the
    qwen25 format (gpt-oss: its own format, as gpt-oss is served)."""
    urls = {"qwen25": mesh.url}
    with ExitStack() as stack:
        for fmt in ("llama3", "mistral", "pythonic"):
            stack.enter_context(service_process(
                "radixmesh.services.tokenizer",
                *_flags(mesh, urls, fmt, "--tool-call-parser", fmt)))
        for kind in REASONING_PARSERS:
            stack.enter_context(service_process(
                "radixmesh.services.tokenizer",
                *_flags(mesh, urls, kind, "--tool-call-parser",
                        HARMONY if kind == HARMONY else "qwen25", "--reasoning-parser", kind)))
        for url in urls.values():
            _wait_healthy(url)
        yield {name: openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
               for name, url in urls.items()}


@pytest.fixture(scope="module")
def served(fronts: dict[str, openai.OpenAI]) -> str:
    """The served model's name, which every request names."""
    return fronts["qwen25"].models.list().data[0].id


def _flags(mesh: Mesh, urls: dict[str, str], name: str, *parsers: str) -> list[str]:
    port = free_port()
    urls[name] = f"http://127.0.0.1:{port}"
    return ["--nats-url", mesh.nats_url, "--host", "127.0.0.1", "--port", str(port),
            "--grpc-port", "-1", "--replica-id", f"t-{name}", *parsers]


def _wait_healthy(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} never became healthy")


@pytest.mark.parametrize("fmt", CALLS)
def test_each_format_comes_back_as_tool_calls(fronts, served, fmt):
    api = fronts[fmt]
    reply = api.chat.completions.create(model=served, messages=conversation(fmt),
                                        tools=tools(CITY), **GREEDY)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Rome"}

    # Streamed: the name first, then the arguments in pieces adding up to the same call.
    names, pieces, content = [], [], ""
    for chunk in api.chat.completions.create(model=served, messages=conversation(fmt),
                                             tools=tools(CITY), stream=True, **GREEDY):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            assert part.index == 0
            if part.function.name is not None:
                assert not pieces
                names.append(part.function.name)
            pieces.append(part.function.arguments or "")
        last = chunk.choices[0].finish_reason
    assert names == ["get_weather"] and last == "tool_calls" and not content.strip()
    assert json.loads("".join(pieces)) == {"city": "Rome"}
    if fmt != "pythonic":  # a pythonic call's arguments come whole, once the call closes
        assert len([p for p in pieces if p]) > 1


def test_a_started_call_is_held_to_its_schema(fronts, served):
    reply = fronts["qwen25"].chat.completions.create(
        model=served, messages=conversation("qwen25"), tools=tools(CITY_COUNTRY), **GREEDY)
    (call,) = reply.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, CITY_COUNTRY)
    assert arguments["city"] == "Rome"


def test_a_tool_result_sent_back_gets_an_answer(fronts, served):
    api = fronts["qwen25"]
    messages = conversation("qwen25")
    first = api.chat.completions.create(model=served, messages=messages,
                                        tools=tools(CITY), **GREEDY).choices[0].message
    messages += [first.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": first.tool_calls[0].id,
                  "content": "22 degrees, cloudy"}]
    reply = api.chat.completions.create(model=served, messages=messages, tools=tools(CITY),
                                        **GREEDY)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert "22" in choice.message.content


THINKING = [
    {"role": "system", "content": "Think step by step inside <think></think>, then answer."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant",
     "content": "<think>\nTwo plus two makes four.\n</think>\n\nThe answer is 4."},
    {"role": "user", "content": "What is 3 + 5?"},
]


def test_reasoning_comes_back_apart(fronts, served):
    api = fronts["qwen3"]
    message = api.chat.completions.create(model=served, messages=THINKING,
                                          **GREEDY).choices[0].message
    assert message.reasoning_content and "<think>" not in message.reasoning_content
    assert message.content and "</think>" not in message.content
    reasoning, content = "", ""
    for chunk in api.chat.completions.create(model=served, messages=THINKING, stream=True,
                                             **GREEDY):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)

    # With thinking off the whole text is the answer.
    off = api.chat.completions.create(
        model=served, messages=THINKING, **GREEDY,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert off.content.startswith("<think>") and getattr(off, "reasoning_content", None) is None


# Two earlier turns in harmony, which SmolLM2 then keeps to: it thinks in the analysis
# channel and answers in the final one.
HARMONY_THINKING = [
    {"role": "system", "content": "Think in the analysis channel, then answer in the final "
                                  "channel."},
    *[turn for question, thought, answer in [
        ("What is 2 + 2?", "Two plus two makes four.", "The answer is 4."),
        ("What is 1 + 6?", "One plus six makes seven.", "The answer is 7.")]
      for turn in [{"role": "user", "content": question}, {"role": "assistant", "content": (
          f"<|channel|>analysis<|message|>{thought}<|end|><|start|>assistant<|channel|>final"
          f"<|message|>{answer}")}]],
    {"role": "user", "content": "What is 3 + 5?"},
]


def test_gpt_oss_reasoning_comes_back_apart(fronts, served):
    api = fronts[HARMONY]
    message = api.chat.completions.create(model=served, messages=HARMONY_THINKING,
                                          **GREEDY).choices[0].message
    assert message.reasoning_content and message.content
    assert "<|" not in message.reasoning_content + message.content
    reasoning, content = "", ""
    for chunk in api.chat.completions.create(model=served, messages=HARMONY_THINKING,
                                             stream=True, **GREEDY):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)
    # Unparsed, the answer is the harmony text the parser read.
    raw = api.chat.completions.create(model=served, messages=HARMONY_THINKING, **GREEDY,
                                      extra_body={"separate_reasoning": False})
    assert raw.choices[0].message.content == (
        f"<|channel|>analysis<|message|>{message.reasoning_content}<|end|><|start|>assistant"
        f"<|channel|>final<|message|>{message.content}")


def test_gpt_oss_refuses_what_it_cannot_constrain(fronts, served):
    for fields in (CONSTRAINED["json_schema"], {"extra_body": {"thinking_budget": 8}},
                   CONSTRAINED["required"]):
        with pytest.raises(openai.BadRequestError, match="gpt-oss reasoning parser") as err:
            fronts[HARMONY].chat.completions.create(model=served, messages=QUESTION,
                                                    **GREEDY, **fields)
        assert err.value.body["param"] == "reasoning_parser"
    with pytest.raises(openai.BadRequestError, match="reasoning_effort must be one of"):
        fronts[HARMONY].chat.completions.create(model=served, messages=QUESTION, **GREEDY,
                                                extra_body={"reasoning_effort": "max"})


def test_a_json_answer_follows_the_reasoning(fronts, served):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}
    message = fronts["qwen3"].chat.completions.create(
        model=served, messages=THINKING, **GREEDY,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    ).choices[0].message
    assert message.reasoning_content
    jsonschema.validate(json.loads(message.content), schema)


# ---- a constrained answer after the thinking, under every reasoning parser and none ----------

ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}},
          "required": ["answer"], "additionalProperties": False}
# Bounded strings: a model free to write a string runs on in it as long as it likes.
PLACE = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
         "required": ["city"], "additionalProperties": False}
ZONE = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
        "required": ["zone"], "additionalProperties": False}
PARAMETERS = {"get_weather": PLACE, "get_time": ZONE}
TOOLS = [*tools(PLACE), {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone.", "parameters": ZONE}}]
QUESTION = [{"role": "user", "content": "What is 3 + 5?"}]
CONSTRAINED = {
    "regex": {"extra_body": {"regex": r"(yes|no), [0-9]{1,2}"}},
    "json_schema": {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "a", "schema": ANSWER}}},
    "ebnf": {"extra_body": {"ebnf": 'root ::= "3 + 5 = " [0-9] [0-9]?'}},
    "structural_tag": {"extra_body": {"structural_tag": json.dumps({
        "type": "structural_tag", "format": {
            "type": "tag", "begin": "<answer>", "end": "</answer>",
            "content": {"type": "json_schema", "json_schema": ANSWER}}})}},
    "required": {"tools": TOOLS, "tool_choice": "required"},
    "named": {"tools": TOOLS,
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
}
# Each kind reads its own switch: together they turn thinking on for all of them.
THINKING_ON = {"enable_thinking": True, "thinking": True}
# SmolLM2 was never taught to close a thinking block (nor to open one, but offered `<think>`
# before a JSON answer it takes it): it may think this many tokens before the block is closed
# for it.
BUDGET = 8
CASES = [(kind, constraint) for kind in ("none", *REASONING_PARSERS) if kind != HARMONY
         for constraint in CONSTRAINED]


@pytest.fixture(scope="module")
def constrained(fronts, served) -> dict[tuple[str, str], Choice]:
    """Each case's choice, the requests sent all at once."""
    assert all(thinking_enabled(kind, THINKING_ON) for kind in REASONING_PARSERS)

    def ask(kind: str, constraint: str) -> Choice:
        fields = dict(CONSTRAINED[constraint])
        extra = dict(fields.pop("extra_body", {}))
        if kind != "none":
            extra.update(chat_template_kwargs=THINKING_ON, thinking_budget=BUDGET)
        api = fronts["qwen25" if kind == "none" else kind]
        return api.chat.completions.create(model=served, messages=QUESTION, temperature=0,
                                           max_tokens=64, extra_body=extra,
                                           **fields).choices[0]

    with ThreadPoolExecutor(4) as pool:
        asked = {case: pool.submit(ask, *case) for case in CASES}
        return {case: future.result() for case, future in asked.items()}


@pytest.mark.parametrize(("kind", "constraint"), CASES)
def test_a_constrained_answer_follows_the_thinking(constrained, kind, constraint):
    """The answer after the thinking is whole and valid for its constraint, whichever
    reasoning parser reads it (or none), and ends because it is complete, not by length."""
    choice = constrained[kind, constraint]
    message = choice.message
    if constraint in ("required", "named"):
        assert choice.finish_reason == "tool_calls", message
        (call,) = message.tool_calls
        assert constraint == "required" or call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments),
                            PARAMETERS[call.function.name])
        return
    assert choice.finish_reason == "stop", message
    answer = message.content
    if constraint == "regex":
        assert re.fullmatch(r"(yes|no), [0-9]{1,2}", answer), answer
    elif constraint == "ebnf":
        assert re.fullmatch(r"3 \+ 5 = [0-9]{1,2}", answer), answer
    else:
        if constraint == "structural_tag":
            tagged = re.fullmatch(r"<answer>(.*)</answer>", answer, re.DOTALL)
            assert tagged, answer
            answer = tagged[1]
        jsonschema.validate(json.loads(answer), ANSWER)


def test_an_unclosed_thinking_is_cut_by_length_without_a_budget(fronts, served):
    """Where the template opens the thinking, the constraint waits for `</think>`: without a
    thinking_budget, a model that never writes it is cut by max_tokens, all it wrote being
    reasoning and no answer."""
    choice = fronts["deepseek-r1"].chat.completions.create(
        model=served, messages=QUESTION, temperature=0, max_tokens=12,
        **CONSTRAINED["json_schema"]).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content == "" and choice.message.reasoning_content


def test_an_urgent_request_preempts_a_batch_job(mesh):
    """Two long low-priority requests hold both seats and two more wait; an urgent one
    arriving through native /generate starts before the waiting ones by preempting a running
    one, which later resumes and ends with the tokens it gets alone."""
    long = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
    prompts = {name: f"Write a long story about {name}." for name in
               ("a fox", "a ship", "a tree", "a lake", "an owl")}
    started: list[str] = []

    async def run(client: httpx.AsyncClient, name: str, priority: int, seen: asyncio.Event
                  ) -> list[int]:
        body = {"text": prompts[name], "sampling_params": long, "priority": priority,
                "stream": True}
        ids: list[int] = []
        async with client.stream("POST", "/generate", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    if not seen.is_set():
                        started.append(name)
                        seen.set()
                    ids = json.loads(line[6:])["output_ids"]
        return ids

    async def waiting(client: httpx.AsyncClient, n: int) -> None:
        while (await client.get("/server_info")).json()["internal_states"][0]["waiting"] < n:
            await asyncio.sleep(0.05)

    async def idle(client: httpx.AsyncClient) -> dict:
        """The engine's state once no request runs or holds KV slots."""
        while True:
            info = (await client.get("/server_info")).json()["internal_states"][0]
            if info["running"] == info["held_slots"] == 0:
                return info
            await asyncio.sleep(0.05)

    async def main() -> tuple[dict[str, list[int]], dict[str, list[int]], dict]:
        async with httpx.AsyncClient(base_url=mesh.url, timeout=120) as client:
            events = {name: asyncio.Event() for name in prompts}
            tasks = {}
            for name in ("a fox", "a ship"):
                tasks[name] = asyncio.create_task(run(client, name, 0, events[name]))
                await events[name].wait()
            for name in ("a tree", "a lake"):
                tasks[name] = asyncio.create_task(run(client, name, 0, events[name]))
            await waiting(client, 2)
            tasks["an owl"] = asyncio.create_task(run(client, "an owl", 20, events["an owl"]))
            together = {name: await task for name, task in tasks.items()}
            info = await idle(client)
            alone = {name: await run(client, name, 0, asyncio.Event()) for name in prompts}
            return together, alone, info

    together, alone, info = asyncio.run(main())
    assert started[:2] == ["a fox", "a ship"] and started[2] == "an owl", started
    assert info["num_preemptions"] == 1
    assert together == alone
