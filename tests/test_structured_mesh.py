"""Structured generation through the whole mesh on the real SmolLM2 (float32): a regex, a
JSON schema or an EBNF grammar on native /generate, response_format and SGLang's extra
fields on the OpenAI endpoints, bad constraints refused with a 400, and constrained and free
requests sharing a batch."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from process_helpers import running_mesh

from radixmesh.launcher import Mesh

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema validates the JSON answers")

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "hobbies": {
            "type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3,
        },
    },
    "required": ["name", "age", "role", "hobbies"],
    "additionalProperties": False,
}
ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> Iterator[Mesh]:
    log_dir = tmp_path_factory.mktemp("structured-mesh-logs")
    with running_mesh(log_dir, dtype="float32", max_total_tokens=8192) as m:
        yield m


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=mesh.url, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def oa(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(oa: openai.OpenAI) -> str:
    return oa.models.list().data[0].id


def generate(client: httpx.Client, text: str | list[str], params: dict | list[dict]) -> dict:
    reply = client.post("/generate", json={"text": text, "sampling_params": params})
    assert reply.status_code == 200, reply.text
    return reply.json()


def sse_events(response: httpx.Response) -> list[dict]:
    """Every `data:` payload of an SSE stream; the stream must end with [DONE]."""
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def parse_arithmetic(text: str) -> None:
    """Accept `text` as an expression of ARITHMETIC (a recursive descent parser), or fail."""
    pos = 0

    def peek() -> str:
        return text[pos] if pos < len(text) else ""

    def expr() -> None:
        nonlocal pos
        term()
        while peek() and peek() in "+-":
            pos += 1
            term()

    def term() -> None:
        nonlocal pos
        factor()
        while peek() and peek() in "*/":
            pos += 1
            factor()

    def factor() -> None:
        nonlocal pos
        if peek() == "(":
            pos += 1
            expr()
            assert peek() == ")", f"')' expected at {pos} of {text!r}"
            pos += 1
            return
        start = pos
        while peek() and peek() in "0123456789":
            pos += 1
        assert pos > start, f"a number expected at {pos} of {text!r}"

    expr()
    assert pos == len(text), f"trailing {text[pos:]!r} in {text!r}"


def test_regex_phone_number_plain_and_streamed(client):
    body = {"text": "Call me at my office phone number, which is",
            "sampling_params": {"temperature": 0, "max_new_tokens": 32, "regex": PHONE}}
    reply = client.post("/generate", json=body)
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert re.fullmatch(PHONE, out["text"]), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]

    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    texts = [e["text"] for e in events]
    # SGLang's native stream carries the text so far: each chunk extends the one before.
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False)), texts
    assert re.fullmatch(PHONE, texts[-1]), texts
    assert texts[-1] == out["text"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "stop"


def test_json_schema_sampled_with_five_seeds_validates(client):
    prompts = ["Describe a user of our website as JSON:"] * 5
    params = [{"temperature": 0.8, "seed": seed, "max_new_tokens": 160,
               "json_schema": json.dumps(PERSON)} for seed in range(1, 6)]
    outs = generate(client, prompts, params)
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        value = json.loads(out["text"])
        jsonschema.validate(value, PERSON)
        # No free whitespace (any_whitespace=False): xgrammar's default separators ", " and
        # ": ", the properties in the schema's order, as json.dumps writes it.
        assert out["text"] == json.dumps(value, ensure_ascii=False)
    assert len({o["text"] for o in outs}) > 1  # the seeds sampled different answers
    # The keys and punctuation were appended by jump-forward, not sampled.
    assert client.get("/server_info").json()["internal_states"][0]["forced_tokens"] > 0


def test_ebnf_arithmetic_grammar(client):
    # This prompt ends on its own (most run on, "2+3+4+..." to max_new_tokens).
    out = generate(client, "Give a math expression: ",
                   {"temperature": 0, "max_new_tokens": 48, "ebnf": ARITHMETIC})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    parse_arithmetic(out["text"])
    assert re.fullmatch(r"[0-9+\-*/()]+", out["text"])
    assert "(" in out["text"]  # the recursive rule was taken
    with pytest.raises(AssertionError):
        parse_arithmetic("1+(2*")  # the parser does refuse


def test_constrained_answer_cut_by_max_new_tokens_ends_as_length(client):
    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 200}},
              "required": ["story"]}
    out = generate(client, "Tell me a long story as JSON:",
                   {"temperature": 0, "max_new_tokens": 5, "json_schema": json.dumps(schema)})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert out["meta_info"]["completion_tokens"] == 5
    assert out["text"].startswith('{"story": "'), out["text"]
    with pytest.raises(json.JSONDecodeError):
        json.loads(out["text"])


def test_openai_response_format_and_regex(oa, model):
    messages = [{"role": "user", "content": "Invent a person and describe them."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    chat = oa.chat.completions.create(model=model, messages=messages, max_tokens=160,
                                      temperature=0, response_format=response_format)
    content = chat.choices[0].message.content
    jsonschema.validate(json.loads(content), PERSON)
    assert chat.choices[0].finish_reason == "stop"

    chunks = list(oa.chat.completions.create(
        model=model, messages=messages, max_tokens=160, temperature=0,
        response_format=response_format, stream=True,
    ))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(streamed), PERSON)
    assert streamed == content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"

    sampled = oa.chat.completions.create(model=model, messages=messages, max_tokens=160, n=2,
                                         temperature=0.8, seed=11, response_format=response_format)
    assert len(sampled.choices) == 2
    for choice in sampled.choices:  # each choice keeps a matcher of its own
        jsonschema.validate(json.loads(choice.message.content), PERSON)

    obj = oa.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Return a JSON object with a name and an age."}],
        max_tokens=160, temperature=0, response_format={"type": "json_object"},
    )
    assert obj.choices[0].finish_reason == "stop", obj
    assert isinstance(json.loads(obj.choices[0].message.content), dict)

    done = oa.completions.create(model=model, prompt="The office phone number is",
                                 max_tokens=32, temperature=0, extra_body={"regex": PHONE})
    assert re.fullmatch(PHONE, done.choices[0].text), done.choices[0].text
    assert done.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("constraint", "needle"),
    [
        ({"json_schema": "{oops"}, "json_schema"),
        ({"regex": "(a"}, "regex"),
        ({"ebnf": "root ::= undefined"}, "ebnf"),
        ({"regex": PHONE, "json_schema": json.dumps(PERSON)}, "at most one"),
    ],
)
def test_bad_native_constraint_is_a_400(client, constraint, needle):
    r = client.post("/generate", json={"text": "hi", "sampling_params": {
        "max_new_tokens": 4, **constraint}})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.text
    assert generate(client, "hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("response_format", "needle"),
    [
        ({"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nope"}}},
         "json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "name"),
        ({"type": "xml"}, "response_format"),
    ],
)
def test_bad_response_format_is_a_400(oa, model, response_format, needle):
    for create, kwargs in [
        (oa.chat.completions.create, {"messages": [{"role": "user", "content": "hi"}],
                                      "response_format": response_format}),
        # The client's completions.create has no response_format: the body carries it.
        (oa.completions.create, {"prompt": "hi",
                                 "extra_body": {"response_format": response_format}}),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            create(model=model, max_tokens=4, **kwargs)
        assert err.value.status_code == 400
        assert needle in err.value.message, err.value.message
        assert err.value.body["param"] == "response_format", err.value.body
    with pytest.raises(openai.BadRequestError) as err:
        oa.completions.create(model=model, prompt="hi", max_tokens=4, extra_body={"regex": "(a"})
    assert "regex" in err.value.message and err.value.body["param"] == "regex", err.value.body
    ok = oa.completions.create(model=model, prompt="hi", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


def test_response_format_and_a_regex_together_are_a_400(oa, model):
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            response_format={"type": "json_object"}, extra_body={"regex": PHONE},
        )
    assert "at most one" in err.value.message, err.value.message
    ok = oa.completions.create(model=model, prompt="hi", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


def test_mixed_batch_constrained_and_free(client):
    free = {"temperature": 0, "max_new_tokens": 16}
    prompts = ["My phone number is", "Describe a user as JSON:", "The capital of France is",
               "Give a math expression: "]
    params = [
        {"temperature": 0, "max_new_tokens": 32, "regex": PHONE},
        {"temperature": 0.8, "seed": 7, "max_new_tokens": 160, "json_schema": json.dumps(PERSON)},
        free,
        {"temperature": 0, "max_new_tokens": 48, "ebnf": ARITHMETIC},
    ]
    phone, person, plain, sum_ = generate(client, prompts, params)
    assert re.fullmatch(PHONE, phone["text"]), phone["text"]
    jsonschema.validate(json.loads(person["text"]), PERSON)
    assert sum_["meta_info"]["finish_reason"]["type"] == "stop", sum_
    parse_arithmetic(sum_["text"])
    alone = generate(client, prompts[2], free)
    assert plain["output_ids"] == alone["output_ids"]
    assert plain["text"] == alone["text"]


def test_a_forced_tool_call_through_the_openai_client(oa, model):
    weather = {"type": "object",
               "properties": {"city": {"type": "string", "maxLength": 20},
                              "unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}},
             {"type": "function", "function": {"name": "get_time"}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = oa.chat.completions.create(model=model, messages=messages, tools=tools,
                                       tool_choice=named, max_tokens=48, temperature=0)
    (call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), weather)
    stream = oa.chat.completions.create(model=model, messages=messages, tools=tools,
                                        tool_choice=named, max_tokens=48, temperature=0,
                                        stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    (streamed,) = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    assert streamed.function.arguments == call.function.arguments
    assert deltas[-1].finish_reason == "tool_calls"
    required = oa.chat.completions.create(model=model, messages=messages, tools=tools,
                                          tool_choice="required", max_tokens=64, temperature=0)
    (picked,) = required.choices[0].message.tool_calls
    assert picked.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(picked.function.arguments), dict)


def test_only_the_worker_loads_torch_or_a_grammar_library(mesh, client, oa, model):
    """After requests of every kind (constrained and free, native and OpenAI, streamed,
    refused), the tokenizer, scheduler and detokenizer hold no torch and no grammar
    library: the worker compiles every constraint, the front door checks only its form."""
    assert generate(client, "Call", {"max_new_tokens": 16, "regex": PHONE})["text"]
    refused = client.post("/generate", json={"text": "hi", "sampling_params": {
        "max_new_tokens": 4, "ebnf": "root ::= undefined"}})
    assert refused.status_code == 400, refused.text
    with client.stream("POST", "/generate", json={
            "text": "hi", "sampling_params": {"max_new_tokens": 4}, "stream": True}) as r:
        assert sse_events(r)
    oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                               max_tokens=8, response_format={"type": "json_object"})
    for child in mesh.children:
        maps = Path(f"/proc/{child.proc.pid}/maps").read_text()
        loaded = {lib for lib in ("libtorch_cpu", "xgrammar", "llguidance") if lib in maps}
        if child.service == "worker":
            assert {"libtorch_cpu", "xgrammar"} <= loaded, loaded
        else:
            assert not loaded, (child.name, loaded)
