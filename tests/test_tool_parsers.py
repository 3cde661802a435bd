"""Tool-call parsers on texts each model family writes: whole answers (`parse`), the same
answers streamed in every two-chunk split and one character at a time (which must agree
with `parse`), the few cases where a committed stream call cannot agree, answers cut
anywhere (the same stream however split), and the structure texts a constrained call is
generated in."""

from __future__ import annotations

import json

import pytest

from radixmesh.core.tool_formats import TOOL_PARSERS, Qwen25ToolParser, tool_parser
from radixmesh.core.tool_parsers import ToolCall, ToolCallDelta

TOOLS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
    },
    "search": {
        "type": "object",
        "properties": {"query": {"type": "string"}, "filters": {"type": "object"}},
        "required": ["query"],
    },
    "now": {"type": "object", "properties": {}},
    "wetter_ü": {"type": "object"},
}

PARIS = {"city": "Paris", "unit": "celsius"}
NESTED = {
    "query": 'say "hi" {now} \\ [done]',
    "filters": {"tags": ["a}", "{b", "]"], "deep": {"x": {"y": [1, 2.5, {"z": None}]}}},
}
UNICODE = {"city": "Zürich 東京 🌧"}
CALL_PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
CALL_NOW = '{"name": "now", "arguments": {}}'
CALL_UNKNOWN = '{"name": "launch_rocket", "arguments": {}}'
LLAMA_PARIS = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'


def qwen(call: str) -> str:
    return f"<tool_call>\n{call}\n</tool_call>"


def call_text(name: str, arguments: dict[str, object], key: str = "arguments") -> str:
    return f'{{"name": "{name}", "{key}": {json.dumps(arguments, ensure_ascii=False)}}}'


QWEN_PARIS = qwen(CALL_PARIS)
QWEN_NOW = qwen(CALL_NOW)


def harmony(name: str, arguments: str, start: str = "<|start|>assistant") -> str:
    """gpt-oss's call message, as its reasoning parser passes it on (start "") or raw."""
    return (f"{start}<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
            f"{arguments}<|call|>")


HARMONY_PARIS = harmony("get_weather", json.dumps(PARIS))

# (kind, answer, content, calls as (name, arguments)); streaming must agree with all of them.
CASES = [
    ("qwen25", QWEN_PARIS, "", [("get_weather", PARIS)]),
    ("qwen25", f"{QWEN_PARIS}\n{QWEN_NOW}\n", "", [("get_weather", PARIS), ("now", {})]),
    (
        "qwen25",
        f"Let me look that up.\n{QWEN_PARIS}\n\nOne moment.",
        "Let me look that up.\n\n\nOne moment.",
        [("get_weather", PARIS)],
    ),
    (
        "qwen25",
        "Write <tool> or <tool_call without a brace; {braces} and [brackets] are prose.",
        "Write <tool> or <tool_call without a brace; {braces} and [brackets] are prose.",
        [],
    ),
    ("qwen25", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    (
        "qwen25",
        '<tool_call>\n{"name": "get_weather" "arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather" "arguments": {"city": "Paris"}}\n</tool_call>',
        [],
    ),
    (
        "qwen25",
        f"{QWEN_NOW}\n{qwen(CALL_UNKNOWN)}",
        qwen(CALL_UNKNOWN),
        [("now", {})],
    ),
    (
        "qwen25",
        qwen(call_text("search", NESTED)),
        "",
        [("search", NESTED)],
    ),
    (
        "qwen25",
        "Wetter?\n" + qwen(call_text("get_weather", UNICODE)),
        "Wetter?",
        [("get_weather", UNICODE)],
    ),
    ("qwen25", '<tool_call>\n{"name": "now", "arguments": {}}', "", [("now", {})]),
    (
        "qwen25",
        '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call> ok',
        "ok",
        [("get_weather", {"city": "Oslo"})],
    ),
    ("llama3", f"<|python_tag|>{LLAMA_PARIS}", "", [("get_weather", PARIS)]),
    ("llama3", f"\n\n{LLAMA_PARIS}", "", [("get_weather", PARIS)]),
    (
        "llama3",
        f'{LLAMA_PARIS}; {{"name": "now", "arguments": {{}}}}',
        "",
        [("get_weather", PARIS), ("now", {})],
    ),
    (
        "llama3",
        f"Checking the weather.<|python_tag|>{LLAMA_PARIS}\nDone.",
        "Checking the weather.\nDone.",
        [("get_weather", PARIS)],
    ),
    (
        "llama3",
        'The set {1, 2} is small; {"name": "now", "parameters": {}} is JSON.',
        'The set {1, 2} is small; {"name": "now", "parameters": {}} is JSON.',
        [],
    ),
    ("llama3", "{x} marks the spot", "{x} marks the spot", []),
    ("llama3", '{"city": "Paris", "temp": 21}', '{"city": "Paris", "temp": 21}', []),
    (
        "llama3",
        '{"name": get_weather, "parameters": {"city": "Paris"}}',
        '{"name": get_weather, "parameters": {"city": "Paris"}}',
        [],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "launch_rocket", "parameters": {"target": "moon"}}',
        '<|python_tag|>{"name": "launch_rocket", "parameters": {"target": "moon"}}',
        [],
    ),
    (
        "llama3",
        '<|python_tag|>brave_search.call(query="weather")',
        '<|python_tag|>brave_search.call(query="weather")',
        [],
    ),
    (
        "llama3",
        call_text("search", NESTED, "parameters"),
        "",
        [("search", NESTED)],
    ),
    (
        "llama3",
        call_text("get_weather", UNICODE, "parameters"),
        "",
        [("get_weather", UNICODE)],
    ),
    ("mistral", f"[TOOL_CALLS] [{CALL_PARIS}]", "", [("get_weather", PARIS)]),
    (
        "mistral",
        f'[TOOL_CALLS] [{CALL_PARIS}, {{"name": "now", "arguments": {{}}}}]',
        "",
        [("get_weather", PARIS), ("now", {})],
    ),
    (
        "mistral",
        f"I'll check. [TOOL_CALLS] [{CALL_PARIS}] Back soon.",
        "I'll check.  Back soon.",
        [("get_weather", PARIS)],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]now[ARGS]{}',
        "",
        [("get_weather", PARIS), ("now", {})],
    ),
    (
        "mistral",
        "Lists like [1, 2], [TOOL] and [TOOL_CALLS are prose; [TOOL_CALLS] maybe later.",
        "Lists like [1, 2], [TOOL] and [TOOL_CALLS are prose; [TOOL_CALLS] maybe later.",
        [],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", arguments: {}}]',
        '[TOOL_CALLS] [{"name": "get_weather", arguments: {}}]',
        [],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "launch_rocket", "arguments": {}}]',
        '[TOOL_CALLS] [{"name": "launch_rocket", "arguments": {}}]',
        [],
    ),
    (
        "mistral",
        f"[TOOL_CALLS] [{CALL_NOW}, {CALL_UNKNOWN}]",
        CALL_UNKNOWN,
        [("now", {})],
    ),
    (
        "mistral",
        f"[TOOL_CALLS] [{call_text('search', NESTED)}]",
        "",
        [("search", NESTED)],
    ),
    (
        "mistral",
        f"[TOOL_CALLS]get_weather[ARGS]{json.dumps(UNICODE, ensure_ascii=False)}",
        "",
        [("get_weather", UNICODE)],
    ),
    ("pythonic", '[get_weather(city="Paris", unit="celsius")]', "", [("get_weather", PARIS)]),
    (
        "pythonic",
        "[get_weather(city='Paris', unit='celsius'), now()]",
        "",
        [("get_weather", PARIS), ("now", {})],
    ),
    (
        "pythonic",
        "Sure thing. [now()] Anything else?",
        "Sure thing.  Anything else?",
        [("now", {})],
    ),
    (
        "pythonic",
        "See [1], [the docs](https://x.y/[a]) and [print(x)] for lists like [a, b].",
        "See [1], [the docs](https://x.y/[a]) and [print(x)] for lists like [a, b].",
        [],
    ),
    (
        "pythonic",
        '[get_weather(city="Paris",,)]',
        '[get_weather(city="Paris",,)]',
        [],
    ),
    ("pythonic", '[launch_rocket(target="moon")]', '[launch_rocket(target="moon")]', []),
    ("pythonic", "[get_weather(city=5)]", "[get_weather(city=5)]", []),
    ("pythonic", '[get_weather("Paris")]', '[get_weather("Paris")]', []),
    ("pythonic", "[get_weather(city=os.getcwd())]", "[get_weather(city=os.getcwd())]", []),
    (
        "pythonic",
        '[get_weather(city="Paris"), launch_rocket()]',
        "launch_rocket()",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "pythonic",
        """[search(query='say "hi" {now} \\\\ [done]', """
        """filters={"tags": ("a}", "{b", "]"), "deep": {"x": {"y": [1, 2.5, {"z": None}]}}})]""",
        "",
        [("search", NESTED)],
    ),
    ("pythonic", '[get_weather(city="Zürich 東京 🌧")]', "", [("get_weather", UNICODE)]),
]

CASES += [
    ("gpt-oss", HARMONY_PARIS, "", [("get_weather", PARIS)]),
    ("gpt-oss", harmony("get_weather", json.dumps(PARIS), start=""), "",
     [("get_weather", PARIS)]),
    ("gpt-oss", f"{HARMONY_PARIS}{harmony('now', '{}')}", "", [("get_weather", PARIS),
                                                                ("now", {})]),
    ("gpt-oss", "<|start|>assistant to=functions.search<|channel|>commentary json<|message|>"
     + json.dumps(NESTED), "", [("search", NESTED)]),
    ("gpt-oss", f"Checking the weather.\n{HARMONY_PARIS}", "Checking the weather.",
     [("get_weather", PARIS)]),
    ("gpt-oss", harmony("launch_rocket", "{}"), harmony("launch_rocket", "{}"), []),
    ("gpt-oss", harmony("get_weather", '"Paris"'), harmony("get_weather", '"Paris"'), []),
    ("gpt-oss", "<|start|>assistant<|channel|>final<|message|>Hi",
     "<|start|>assistant<|channel|>final<|message|>Hi", []),
    ("gpt-oss", "Write <| or <|start or <|channel alone.",
     "Write <| or <|start or <|channel alone.", []),
]

# Calls committed on their name whose arguments then fail: `parse` keeps the text as content,
# the stream keeps the call with its arguments as written (kind, answer, raw arguments).
COMMITTED = [
    (
        "qwen25",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": 5}}\n</tool_call>',
        '{"city": 5}',
    ),
    (
        "qwen25",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",}}\n</tool_call>',
        '{"city": "Paris",}',
    ),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}', '{"city": "Paris"}'),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"unit": "kelvin"}}]',
        '{"unit": "kelvin"}',
    ),
    ("gpt-oss", harmony("get_weather", '{"city": 5}'), '{"city": 5}'),
]


def splits(text: str) -> list[list[str]]:
    """Every two-chunk split of `text`, and `text` one character at a time."""
    return [[text[:cut], text[cut:]] for cut in range(len(text) + 1)] + [list(text)]


def stream(kind: str, chunks: list[str]) -> tuple[str, list[ToolCall]]:
    """Feed `chunks`, check the deltas' order, and assemble content and calls."""
    parser = tool_parser(kind, TOOLS)
    content, deltas = "", []
    for delta in [parser.feed(chunk) for chunk in chunks] + [parser.finish()]:
        content += delta.content
        deltas += delta.calls
    names: list[str] = []
    arguments: list[str] = []
    for delta in deltas:
        if delta.index == len(names):
            assert delta.name is not None, "a call's first delta carries its name"
            names.append(delta.name)
            arguments.append(delta.arguments)
        else:
            assert delta.index == len(names) - 1, "calls stream in order, one at a time"
            assert delta.name is None, "only a call's first delta carries its name"
            arguments[-1] += delta.arguments
    return content, [ToolCall(name, args) for name, args in zip(names, arguments, strict=True)]


def as_json(calls: list[ToolCall]) -> list[tuple[str, object]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize(("kind", "text", "content", "calls"), CASES)
def test_parse(kind, text, content, calls):
    parsed_content, parsed = tool_parser(kind, TOOLS).parse(text)
    assert parsed_content == content
    assert as_json(parsed) == calls
    for call in parsed:
        assert call.arguments == json.dumps(json.loads(call.arguments))


@pytest.mark.parametrize(("kind", "text", "content", "calls"), CASES)
def test_stream_agrees_with_parse_at_every_split(kind, text, content, calls):
    for chunks in splits(text):
        streamed_content, streamed = stream(kind, chunks)
        assert streamed_content == content, chunks
        assert as_json(streamed) == calls, chunks


@pytest.mark.parametrize(("kind", "text", "raw"), COMMITTED)
def test_committed_call_keeps_its_arguments_as_written(kind, text, raw):
    assert tool_parser(kind, TOOLS).parse(text) == (text, [])
    for chunks in splits(text):
        assert stream(kind, chunks) == ("", [ToolCall("get_weather", raw)]), chunks


@pytest.mark.parametrize(
    ("kind", "text"), [case[:2] for case in CASES] + [case[:2] for case in COMMITTED]
)
def test_cut_answers_stream_alike_however_split(kind, text):
    # An answer cut anywhere (a length limit) may stream differently from `parse`, but never
    # differently for another chunking.
    for cut in range(len(text) + 1):
        assert stream(kind, [text[:cut]]) == stream(kind, list(text[:cut])), text[:cut]


def test_stream_emits_content_and_arguments_as_they_arrive():
    parser = tool_parser("qwen25", TOOLS)
    assert parser.feed("Hello wor").content == "Hello wor"
    held = parser.feed("ld <tool_")
    assert (held.content, held.calls) == ("ld", [])
    head = parser.feed('call>\n{"name": "get_weather", "arguments": {"ci')
    assert (head.content, head.calls) == ("", [ToolCallDelta(0, "get_weather", '{"ci')])
    tail = parser.feed('ty": "Paris"}}\n</tool_call>')
    assert tail.calls == [ToolCallDelta(0, None, 'ty": "Paris"}')]
    assert parser.finish().calls == []


def test_unknown_function_emits_nothing_before_it_is_content():
    parser = tool_parser("qwen25", TOOLS)
    early = parser.feed('<tool_call>\n{"name": "launch_rocket", "arguments": {"x"')
    assert early.calls == []
    assert early.content.startswith("<tool_call>")


def test_parse_leaves_the_stream_alone():
    parser = tool_parser("mistral", TOOLS)
    first = parser.feed("Note: [TOOL_CALLS] [")
    assert parser.parse(f"[TOOL_CALLS] [{CALL_PARIS}]")[1] == [
        ToolCall("get_weather", json.dumps(PARIS))
    ]
    rest = parser.feed(CALL_PARIS + "]")
    assert (first.content, rest.calls[0].name) == ("Note:", "get_weather")


@pytest.mark.parametrize("kind", ["qwen25", "llama3", "mistral"])
@pytest.mark.parametrize("name", ["get_weather", "search", "now", "wetter_ü"])
@pytest.mark.parametrize("prefix", ["", "Let me call it. "])
def test_structure_round_trip(kind, name, prefix):
    arguments = {"get_weather": UNICODE, "search": NESTED}.get(name, {})
    structure = TOOL_PARSERS[kind].structure(name)
    assert structure is not None
    begin, end = structure
    assert begin.startswith(TOOL_PARSERS[kind].trigger)
    text = prefix + begin + json.dumps(arguments) + end
    expected = (prefix.strip(), [ToolCall(name, json.dumps(arguments))])
    assert tool_parser(kind, TOOLS).parse(text) == expected
    for chunks in splits(text):
        content, calls = stream(kind, chunks)
        assert (content, as_json(calls)) == (prefix.strip(), [(name, arguments)])


def test_pythonic_has_no_structure_or_trigger():
    assert TOOL_PARSERS["pythonic"].structure("now") is None
    assert TOOL_PARSERS["pythonic"].trigger is None


def test_names_and_aliases():
    assert TOOL_PARSERS["qwen"] is TOOL_PARSERS["qwen25"] is Qwen25ToolParser
    for kind, parser in TOOL_PARSERS.items():
        assert isinstance(tool_parser(kind, TOOLS), parser)
        assert TOOL_PARSERS[parser.name] is parser


def test_unknown_kind_names_the_known_ones():
    with pytest.raises(ValueError, match="hermes.*llama3, mistral, pythonic, qwen, qwen25"):
        tool_parser("hermes", TOOLS)


def test_invalid_schema_is_refused():
    with pytest.raises(ValueError, match="'broken'"):
        tool_parser("qwen25", {"broken": {"type": "no-such-type"}})
