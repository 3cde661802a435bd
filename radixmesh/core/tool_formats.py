"""The tool-call formats of SGLang's `--tool-call-parser` (qwen25/qwen, llama3, mistral,
pythonic, gpt-oss), each a ToolParser (radixmesh.core.tool_parsers) that recognises its own unit of
call text; `tool_parser` picks one by name and `tool_constraint` holds a format's calls to
their tools' schemas."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from typing import Any

from radixmesh.core.grammar import tool_calls_tag
from radixmesh.core.harmony import CALL, CHANNEL, END, MESSAGE, START, read_header
from radixmesh.core.tool_parsers import INVALID, Call, ToolParser, Unit, loads, skip_space

_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_MISTRAL_NAME = re.compile(r"[\w.\-]+")
_MISTRAL_ARGS = "[ARGS]"
_QWEN_END = "</tool_call>"


def _json_value(value: Any) -> Any:
    """A Python literal as JSON data (tuples become lists); TypeError for anything else."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_json_value(item) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: _json_value(item) for key, item in value.items()}
    raise TypeError(f"{type(value).__name__} is not JSON")


def _python_arguments(source: str) -> Any:
    """The keyword arguments of one Python call `f(a=1, b="x")` as a dict, read with `ast`
    (never evaluated); INVALID for positional arguments or values that aren't literals."""
    try:
        node = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return INVALID
    if not isinstance(node, ast.Call) or node.args:
        return INVALID
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return INVALID
        try:
            arguments[keyword.arg] = _json_value(ast.literal_eval(keyword.value))
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return INVALID
    return arguments


class Qwen25ToolParser(ToolParser):
    """Qwen2.5 / Qwen3 / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
    blocks anywhere in the answer."""

    name = "qwen25"
    trigger = _opener = "<tool_call>"

    @classmethod
    def structure(cls, name: str) -> tuple[str, str] | None:
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ', "}\n</tool_call>"

    def _scan(self, text: str, final: bool) -> Unit | None:
        # A missing end tag at the end of the answer is forgiven: a stop string may have cut it.
        return self._sequence(text, len(self._opener), final, self._json_call, "", _QWEN_END)


class Llama3ToolParser(ToolParser):
    """Llama 3.x JSON calls: optional `<|python_tag|>`, then `{"name": ..., "parameters": {...}}`
    objects separated by `;`. Without the tag the answer must start with the object."""

    name = "llama3"
    trigger = _opener = "<|python_tag|>"

    @classmethod
    def structure(cls, name: str) -> tuple[str, str] | None:
        return f'<|python_tag|>{{"name": {json.dumps(name)}, "parameters": ', "}"

    def _find(self, text: str, fresh: bool) -> int | None:
        first = skip_space(text, 0)
        if fresh and text.startswith("{", first):
            return first
        return super()._find(text, fresh)

    def _scan(self, text: str, final: bool) -> Unit | None:
        start = len(self._opener) if text.startswith(self._opener) else 0
        return self._sequence(text, start, final, self._json_call, ";", "")


class MistralToolParser(ToolParser):
    """Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, or the newer
    `[TOOL_CALLS]name[ARGS]{...}` with one marker per call; text before it is content."""

    name = "mistral"
    trigger = _opener = "[TOOL_CALLS]"

    @classmethod
    def structure(cls, name: str) -> tuple[str, str] | None:
        return f'[TOOL_CALLS] [{{"name": {json.dumps(name)}, "arguments": ', "}]"

    def _scan(self, text: str, final: bool) -> Unit | None:
        at = skip_space(text, len(self._opener))
        if at == len(text):
            return None if final else Unit([], None)
        if text[at] == "[":
            return self._sequence(text, at + 1, final, self._json_call, ",", "]")
        return self._sequence(text, at, final, self._named_call, "", "")

    def _named_call(self, text: str, at: int) -> Call | None:
        name = _MISTRAL_NAME.match(text, at)
        if name is None:
            return None
        tail = text[name.end() : name.end() + len(_MISTRAL_ARGS)]
        if tail != _MISTRAL_ARGS:
            return Call(at) if _MISTRAL_ARGS.startswith(tail) else None
        args_start = skip_space(text, name.end() + len(_MISTRAL_ARGS))
        if args_start == len(text):
            return Call(at)
        if text[args_start] != "{":
            return None
        end = self._span(text, args_start)
        call = Call(at, name.group(), args_start=args_start, args_end=end, end=end)
        if end is not None:
            call.arguments = loads(text[args_start:end])
        return call


class PythonicToolParser(ToolParser):
    """Python call syntax with literal keyword arguments, `[f(a=1, b="x"), g()]`, anywhere in
    the answer (Llama 3.2+ templates, ToolACE)."""

    name = "pythonic"
    trigger = None
    _opener = "["

    def _scan(self, text: str, final: bool) -> Unit | None:
        return self._sequence(text, 1, final, self._python_call, ",", "]")

    def _python_call(self, text: str, at: int) -> Call | None:
        identifier = _IDENTIFIER.match(text, at)
        if identifier is None:
            return None
        if identifier.end() == len(text):
            return Call(at)
        if text[identifier.end()] != "(":
            return None
        call = Call(at, identifier.group(), end=self._span(text, identifier.end(), "'\""))
        if call.end is not None:
            call.arguments = _python_arguments(text[at : call.end])
        return call


class GptOssToolParser(ToolParser):
    """gpt-oss's harmony messages addressed to a function (radixmesh.core.harmony):
    `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`, with
    or without `<|start|>assistant` before it, the recipient before or after the channel. One
    message is one call; other harmony text is content (the gpt-oss reasoning parser takes
    the reasoning and the answer's headers out first)."""

    name = "gpt-oss"
    trigger = None  # calls are read, not constrained: the format has no single opening text
    _opener = START

    def _find(self, text: str, fresh: bool) -> int | None:
        at = 0
        while True:
            starts = [i for m in (START, CHANNEL) if (i := text.find(m, at)) >= 0]
            if not starts:
                return None
            at = min(starts)
            header = text[at:].split(MESSAGE, 1)[0]
            if MESSAGE not in text[at:] or read_header(header).function is not None:
                return at  # a call's header, or one that may still name a function
            at += 1

    def _hold(self, text: str) -> int:
        for marker in (START, CHANNEL):
            for size in range(min(len(text), len(marker) - 1), 0, -1):
                if text.endswith(marker[:size]):
                    return size
        return 0

    def _scan(self, text: str, final: bool) -> Unit | None:
        head_end = text.find(MESSAGE)
        if head_end < 0:
            return None if final else Unit([Call(0)], None)
        name = read_header(text[:head_end]).function
        if name is None:
            return None
        args_start = skip_space(text, head_end + len(MESSAGE))
        if args_start == len(text):
            return None if final else Unit([Call(0, name)], None)
        if text[args_start] != "{":
            return None
        args_end = self._span(text, args_start)
        call = Call(0, name, args_start=args_start, args_end=args_end)
        if args_end is None:
            return Unit([call], len(text) if final else None)
        call.arguments = loads(text[args_start:args_end])
        close = skip_space(text, args_end)
        for marker in (CALL, END):
            if text.startswith(marker, close):
                call.end = close + len(marker)
                return Unit([call], call.end)
            if not final and marker.startswith(text[close:]):
                return Unit([call], None)  # the closing marker may still be coming
        call.end = args_end
        return Unit([call], args_end)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "qwen25": Qwen25ToolParser,
    "qwen": Qwen25ToolParser,
    "llama3": Llama3ToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "gpt-oss": GptOssToolParser,
}


def tool_parser(kind: str, tools: Mapping[str, Mapping[str, Any]]) -> ToolParser:
    """A parser for one answer in the format `kind` (a `--tool-call-parser` name)."""
    return _parser_class(kind)(tools)


def _parser_class(kind: str) -> type[ToolParser]:
    parser = TOOL_PARSERS.get(kind)
    if parser is None:
        raise ValueError(
            f"unknown tool-call parser {kind!r}: expected one of {', '.join(sorted(TOOL_PARSERS))}"
        )
    return parser


def tool_constraint(kind: str, tools: Mapping[str, Mapping[str, Any]], choice: str | None,
                    single: bool = False) -> tuple[str, str] | None:
    """The output constraint (a structural tag) that holds every call the model opens in the
    format `kind` to one of `tools` (name -> parameters schema) and its schema. `choice`:
    None lets the model call as it likes (tool_choice auto), "" requires a call to any of
    them, a name a call to that one; `single`: nothing follows the first call. None where
    the format cannot be constrained that way (pythonic)."""
    parser = _parser_class(kind)
    names = list(tools) if not choice else [choice]
    calls = []
    for name in names:
        wrap = parser.structure(name)
        if wrap is None or parser.trigger is None:
            return None
        calls.append((wrap[0], tools[name], wrap[1]))
    return tool_calls_tag(parser.trigger, calls, required=choice is not None, single=single)
