"""The frontend language: its mechanics on fake backends (role rendering, forks running at
once, streaming, tool calls, errors), then the real model (float32) on the in-process
Engine. The same programs through a mesh's HTTP and gRPC doors are in test_mesh_e2e."""

from __future__ import annotations

import json
import re
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest

from radixmesh import lang

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
WAIT_S = 30  # only a broken implementation ever waits this long


class Scripted:
    """A backend that answers each prompt with words naming its length, records every
    prompt and params it got, and streams its answers a word at a time."""

    def __init__(self, template: lang.ChatTemplate | None = None) -> None:
        self.template = template
        self.prompts: list[str] = []
        self.params: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def answer(self, text: str) -> str:
        return f" reply to {len(text)} chars."

    def generate(self, texts: list[str], params: list[dict[str, Any]], **extra: Any
                 ) -> list[lang.Answer]:
        with self.lock:
            self.prompts += texts
            self.params += params
        return [(self.answer(t), {"prompt_tokens": len(t)}) for t in texts]

    def stream(self, text: str, params: dict[str, Any]) -> Iterator[lang.Chunk]:
        (answer, meta), = self.generate([text], [params])
        for word in re.findall(r"\s*\S+", answer):
            yield word, meta

    def chat_template(self) -> lang.ChatTemplate:
        assert self.template is not None
        return self.template


@pytest.fixture(scope="module")
def template(tokenizer) -> lang.ChatTemplate:
    return lang.ChatTemplate.from_tokenizer(tokenizer)


# ---- roles --------------------------------------------------------------------------------


@lang.function
def chat(s, question):
    s += lang.user(question)
    s += lang.assistant(lang.gen("first", max_tokens=8))
    s += lang.user_begin() + "And " + "then?" + lang.user_end()
    s += lang.assistant_begin()
    s += lang.gen("second", max_tokens=8)
    s += lang.assistant_end()


def test_roles_render_as_the_chat_template_does(tokenizer, template):
    backend = Scripted(template)
    state = chat.run(backend, question="Why?")
    first, second = state["first"], state["second"]
    turns = [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": first},
             {"role": "user", "content": "And then?"}, {"role": "assistant", "content": second}]
    # Before each assistant gen, the prompt is what a chat request would render; SmolLM2's
    # template puts its default system prompt first since the program gave none.
    assert backend.prompts == [tokenizer.apply_chat_template(turns[:1]),
                               tokenizer.apply_chat_template(turns[:3])]
    assert "You are a helpful AI assistant named SmolLM" in backend.prompts[0]
    assert state.text() == tokenizer.apply_chat_template(turns, add_generation_prompt=False)
    assert state.messages() == turns


def test_a_system_message_replaces_the_default_one(tokenizer, template):
    @lang.function
    def program(s):
        s += lang.system("Be brief.")
        s += lang.user("Hi")
        s += lang.assistant_begin() + lang.gen("x")

    backend = Scripted(template)
    program.run(backend)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert backend.prompts == [tokenizer.apply_chat_template(messages)]


def test_a_template_served_as_text_renders_like_the_tokenizer(tokenizer, template):
    served = lang.ChatTemplate.from_source(tokenizer.chat_template, tokenizer.bos_token,
                                           tokenizer.eos_token)
    backend, again = Scripted(template), Scripted(served)
    assert chat.run(backend, question="Q").text() == chat.run(again, question="Q").text()


TRIMMING = ("{% if tools %}[tools: {{ tools | map(attribute='function.name') | join(',') }}]"
            "{% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}"
            "</{{ m['role'] }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def test_a_template_that_rewrites_content_still_closes_each_message():
    @lang.function
    def program(s):
        s += lang.user(" padded ")
        s += lang.assistant("done")

    state = program.run(Scripted(lang.ChatTemplate.from_source(TRIMMING)))
    assert state.text() == "<user> padded </user><assistant>done</assistant>"


def test_role_misuse_is_named():
    template = lang.ChatTemplate.from_source(TRIMMING)

    @lang.function
    def nested(s):
        s += lang.user_begin() + lang.assistant_begin()

    with pytest.raises(ValueError, match="cannot begin inside a user message"):
        nested.run(Scripted(template))

    @lang.function
    def unopened(s):
        s += lang.user_end()

    with pytest.raises(ValueError, match="user_end without user_begin"):
        unopened.run(Scripted(template))

    @lang.function
    def late_tools(s):
        s += lang.user("Hi")
        s += lang.user("Again", tools=[WEATHER])

    with pytest.raises(ValueError, match="give tools with the conversation's first message"):
        late_tools.run(Scripted(template))


# ---- forks run at the same time -----------------------------------------------------------


class Gathering(Scripted):
    """Answers only once `n` generate calls are in flight together: a program whose
    branches ran one after another would never get an answer."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.barrier = threading.Barrier(n, timeout=WAIT_S)

    def generate(self, texts: list[str], params: list[dict[str, Any]], **extra: Any
                 ) -> list[lang.Answer]:
        self.barrier.wait()
        return super().generate(texts, params, **extra)


@lang.function
def three_ways(s):
    s += "Three ways to say hi:"
    forks = s.fork(3)
    for i, branch in enumerate(forks):
        branch += f"\n{i + 1}." + lang.gen(f"way{i}", max_tokens=8, stop="\n")
        branch += " And" + lang.gen(f"more{i}", max_tokens=4)
    forks.join()
    s += "\nDone."


def test_forked_gens_are_in_flight_together_and_answer_as_one_by_one():
    together = three_ways.run(Gathering(3))
    alone = three_ways.run(Scripted())
    assert together.variables == alone.variables
    assert set(together.variables) == {f"{k}{i}" for k in ("way", "more") for i in range(3)}
    assert together.text() == "Three ways to say hi:\nDone."


def test_run_returns_after_the_queued_calls_and_reading_waits():
    gate = threading.Event()

    class Gated(Scripted):
        def generate(self, texts, params, **extra):
            assert gate.wait(WAIT_S)
            return super().generate(texts, params, **extra)

    @lang.function
    def lazy(s):
        s += "x" + lang.gen("y")
        gate.set()  # reached only if `+=` did not wait for the gen

    state = lazy.run(Gated())
    assert state["y"] == " reply to 1 chars."


def test_a_failed_call_skips_the_rest_and_raises_where_the_state_is_read():
    class Failing(Scripted):
        def generate(self, texts, params, **extra):
            if len(self.prompts) == 1:
                raise ValueError("invalid regex")
            return super().generate(texts, params, **extra)

    @lang.function
    def program(s):
        s += "a" + lang.gen("one") + lang.gen("two") + lang.gen("three")

    backend = Failing()
    with pytest.raises(ValueError, match="invalid regex"):
        program.run(backend)
    assert len(backend.prompts) == 1


# ---- streaming ----------------------------------------------------------------------------


def test_text_iter_yields_each_chunk_as_it_comes(template):
    first_seen = threading.Event()

    class Holding(Scripted):
        def stream(self, text, params):
            chunks = super().stream(text, params)
            yield next(chunks)
            assert first_seen.wait(WAIT_S)  # the reader got the first word mid-generation
            yield from chunks

    state = chat.run(Holding(template), stream=True, question="Why?")
    chunks = []
    for chunk in state.text_iter():
        chunks.append(chunk)
        if chunk == " reply":
            first_seen.set()
    assert first_seen.is_set()
    assert "".join(chunks) == state.text()
    words = list(state.text_iter("second"))
    assert len(words) == 4 and "".join(words) == state["second"]


def test_a_streamed_run_raises_its_error_from_text_iter():
    @lang.function
    def program(s):
        s += "a"
        s += lang.user("b")  # no template: the backend cannot render roles

    state = program.run(Scripted(), stream=True)
    with pytest.raises(AssertionError):
        "".join(state.text_iter())


# ---- tools --------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {}}}


@pytest.fixture
def stub_parsers(monkeypatch) -> list[tuple[str, dict, str | None]]:
    """A stand-in for radixmesh.core.tool_formats that reads `<call>name {json}</call>`;
    it records what tool_constraint was asked."""
    asked: list[tuple[str, dict, str | None]] = []

    class Call(types.SimpleNamespace):
        pass

    class Parser:
        def __init__(self, tools):
            self.tools = tools

        def parse(self, text):
            calls = [Call(name=n, arguments=a) for n, a in
                     re.findall(r"<call>(\w+) (\{.*?\})</call>", text) if n in self.tools]
            return re.sub(r"<call>.*?</call>", "", text).strip(), calls

    def tool_constraint(kind, tools, choice):
        asked.append((kind, dict(tools), choice))
        return None if choice is None else ("structural_tag", json.dumps({"tool": choice}))

    module = types.SimpleNamespace(tool_parser=lambda kind, tools: Parser(tools),
                                   tool_constraint=tool_constraint)
    monkeypatch.setitem(sys.modules, "radixmesh.core.tool_formats", module)
    return asked


class Calling(Scripted):
    def answer(self, text):
        return 'Let me look. <call>get_weather {"city": "Paris"}</call>'


def test_gen_with_tools_splits_content_and_calls(stub_parsers):
    @lang.function
    def agent(s, choice):
        s += lang.user("Weather in Paris?", tools=[WEATHER, TIME])
        s += lang.assistant(lang.gen("answer", tools=[WEATHER, TIME], tool_choice=choice))

    template = lang.ChatTemplate.from_source(TRIMMING)
    backend = Calling(template)
    state = agent.run(backend, choice="auto")
    assert backend.prompts == ["[tools: get_weather,get_time]<user>Weather in Paris?</user>"
                               "<assistant>"]
    assert state["answer"] == "Let me look."
    (call,) = state.tool_calls("answer")
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    # The prompt goes on from what the model wrote, calls and all.
    assert state.text().endswith('<call>get_weather {"city": "Paris"}</call></assistant>')
    schemas = {"get_weather": WEATHER["function"]["parameters"],
               "get_time": {"type": "object", "properties": {}}}
    assert stub_parsers == [("qwen25", schemas, None)]
    assert "structural_tag" not in backend.params[0]

    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, required in (("required", ""), (named, "get_weather")):
        state = agent.run(backend, choice=choice)
        assert stub_parsers[-1][2] == required
        assert json.loads(backend.params[-1]["structural_tag"]) == {"tool": required}


def test_gen_reads_calls_with_the_servers_qwen25_parser(monkeypatch):
    from radixmesh.core import tool_formats, tool_parsers

    # Only the parser is under test: auto asks for no constraint.
    monkeypatch.setattr(tool_formats, "tool_constraint", lambda kind, tools, choice: None,
                        raising=False)

    class Qwen(Scripted):
        def answer(self, text):
            return ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": '
                    '{"city": "Paris"}}\n</tool_call>')

    @lang.function
    def agent(s):
        s += "Weather in Paris?" + lang.gen("answer", tools=[WEATHER])

    state = agent.run(Qwen())
    assert state["answer"] == "Checking."
    (call,) = state.tool_calls("answer")
    assert isinstance(call, tool_parsers.ToolCall)
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})


def test_tool_choices_are_checked_where_they_are_written(stub_parsers):
    with pytest.raises(ValueError, match="not among the tools"):
        lang.gen("x", tools=[WEATHER], tool_choice={"type": "function",
                                                    "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="tool_choice must be"):
        lang.gen("x", tools=[WEATHER], tool_choice="sometimes")
    # "none" asks for no calls: nothing is constrained or parsed.
    assert lang.gen("x", tools=[WEATHER], tool_choice="none").tools is None


# ---- the real model, in process -----------------------------------------------------------


@lang.function
def pizza(s, place):
    s += f"The phone number of {place} is " + lang.gen("phone", max_tokens=20, regex=PHONE)
    s += ". The capital of France is"
    s += lang.select("capital", [" Paris", " London", " banana"])


@lang.function
def two_ideas(s, topic):
    s += f"Here is a long list of ideas about {topic}, one per line, each different.\n" * 8
    branches = s.fork(2)
    for i, branch in enumerate(branches):
        branch += f"Idea {i + 1}:"
        branch += lang.gen(f"idea{i}", max_tokens=8, stop="\n")
    s.join(branches)


@pytest.fixture(scope="module")
def backend(engine) -> lang.EngineBackend:
    return lang.EngineBackend(engine)


def test_gen_with_a_regex_and_select(backend):
    state = pizza.run(backend, place="Luigi's")
    assert re.fullmatch(PHONE, state["phone"])
    assert state["capital"] == " Paris"
    paris, london, banana = state.scores["capital"]
    assert paris > london > banana
    assert state.text().endswith(f"{state['phone']}. The capital of France is Paris")


def test_forks_share_their_prefix_and_answer_as_alone(backend, engine):
    state = two_ideas.run(backend, topic="gardens")
    assert set(state.variables) == {"idea0", "idea1"}
    prefix = "Here is a long list of ideas about gardens, one per line, each different.\n" * 8
    for i in range(2):
        alone = engine.generate(prefix + f"Idea {i + 1}:",
                                {"max_new_tokens": 8, "stop": ["\n"], "temperature": 0.0})
        assert state[f"idea{i}"] == alone["text"]
    # Both branches' prompts start with the shared prefix, cached by the first to run.
    assert max(state.meta[f"idea{i}"]["cached_tokens"] for i in range(2)) >= (
        state.meta["idea1"]["prompt_tokens"] - 8)


def test_run_batch_keeps_the_order(backend):
    places = ["Luigi's", "Mario's"]
    states = pizza.run_batch([{"place": p} for p in places], backend)
    assert [s.text().split(" is ")[0] for s in states] == [
        f"The phone number of {p}" for p in places
    ]
    singles = [pizza.run(backend, place=p)["phone"] for p in places]
    assert [s["phone"] for s in states] == singles


def test_a_chat_program_on_the_model_prompts_as_a_chat_request(backend, tokenizer):
    prompts = []

    class Watching(lang.EngineBackend):
        def stream(self, text, params):
            prompts.append(text)
            return super().stream(text, params)

    state = chat.run(Watching(backend.engine), stream=True, question="What is 2+2?")
    chunks = list(state.text_iter())
    assert "".join(chunks) == state.text()
    assert len(list(state.text_iter("first"))) > 1  # the answer came in pieces
    turns = [{"role": "user", "content": "What is 2+2?"},
             {"role": "assistant", "content": state["first"]}]
    assert prompts[0] == tokenizer.apply_chat_template(turns[:1])
    assert state.messages()[:2] == turns
    assert chat.run(backend, question="What is 2+2?").text() == state.text()


def test_a_bad_constraint_surfaces_as_an_error(backend):
    @lang.function
    def bad(s):
        s += "x"
        s += lang.gen("y", regex="(unclosed")

    with pytest.raises(ValueError, match="invalid regex"):
        bad.run(backend)


def test_an_agent_program_calls_a_tool_on_the_model(backend):
    """Shown one earlier call in the qwen25 format, the model calls again; the constraint
    holds the started call to the tool's schema, whose `country` the example never shows."""
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
              "properties": {"city": {"type": "string"}, "country": {"type": "string"}}}
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": schema}}

    @lang.function
    def agent(s):
        s += lang.system("You can call get_weather(city, country) to learn the weather.")
        s += lang.user("What is the weather in Paris?")
        s += lang.assistant('<tool_call>\n{"name": "get_weather", "arguments": '
                            '{"city": "Paris"}}\n</tool_call>')
        s += lang.user("What is the weather in Rome?")
        s += lang.assistant(lang.gen("call", max_tokens=60, temperature=0, tools=[weather]))

    state = agent.run(backend)
    (call,) = state.tool_calls("call")
    arguments = json.loads(call.arguments)
    assert call.name == "get_weather" and arguments["city"] == "Rome"
    assert set(arguments) == {"city", "country"} and state["call"] == ""
