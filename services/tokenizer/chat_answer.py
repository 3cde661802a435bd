"""What a chat answer is made of: the model's reasoning, its text and its tool calls. On the
way in, the request's tools, tool_choice and chat_template_kwargs become the constraint that
shapes the answer; on the way out, the parsers the server runs (`--tool-call-parser`,
`--reasoning-parser`) split the answer into OpenAI's message fields, whole or as stream
deltas.

Tool calls come back three ways. `required` or a named function: the whole answer is
constrained to one call's JSON (no parser needed). `auto` with a parser: the model writes
text and calls in its own format; once it opens a call, the rest of that call is constrained
to the tool's schema (a structural tag), so a started call is always valid. `auto` without a
parser, or `none`: text. A reasoning model thinks first, unconstrained; any constraint
applies to the answer after its thinking, and `thinking_budget` (tokens) closes the thinking
where the model has not by then. The messages themselves are reduced to what a chat template
renders (`chat_messages`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from radixmesh.core import grammar
from radixmesh.core.reasoning import (
    HARMONY,
    HarmonyReasoning,
    ReasoningParser,
    check_kind,
    reasoning_parser,
    thinking_enabled,
)
from radixmesh.core.request import RequestError
from radixmesh.core.sampling_params import GRAMMAR_KINDS
from radixmesh.core.tool_formats import tool_constraint, tool_parser
from radixmesh.core.tool_parsers import ParsedDelta, ToolCall, ToolParser

Json = dict[str, Any]
# A function declared without parameters takes none (OpenAI: "omitting parameters defines a
# function with an empty parameter list"): its arguments are {}.
_NO_PARAMETERS: Json = {"type": "object", "properties": {}, "additionalProperties": False}
# What the chat template itself is given; chat_template_kwargs may not replace them.
# OpenAI's reasoning_effort values.
_EFFORTS = ("none", "minimal", "low", "medium", "high")
_TEMPLATE_ARGS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


@dataclass(frozen=True)
class AnswerShape:
    """How one request's answer is read back."""

    functions: Mapping[str, Json] = field(default_factory=dict)  # tool name -> parameters
    # The function the answer must call, "" for any of them (tool_choice required), None
    # when the model answers in text (and, with `tool_parser`, calls tools as it likes).
    forced: str | None = None
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    thinking: bool = False


@dataclass(frozen=True)
class ChatSetup:
    """A chat request's answer shape and what its chat template is rendered with."""

    shape: AnswerShape
    template_kwargs: Json


def chat_setup(body: Json, tool_call_parser: str | None, reasoning_parser: str | None
               ) -> ChatSetup:
    """Check tools, tool_choice, parallel_tool_calls, chat_template_kwargs, thinking_budget
    and separate_reasoning; write the answer's constraint into the body (json_schema or
    structural_tag, SGLang's fields) and return how to read the answer back."""
    template_kwargs = _template_kwargs(body)
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in _EFFORTS:
            raise RequestError(f"reasoning_effort must be one of {', '.join(_EFFORTS)}, got "
                               f"{effort!r}", "reasoning_effort")
        # The chat templates that know it (gpt-oss's) write it into the system message.
        template_kwargs.setdefault("reasoning_effort", effort)
    tools, functions = _tools(body.get("tools"))
    forced = _tool_choice(body, functions)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise RequestError(f"parallel_tool_calls must be a boolean, got {parallel!r}",
                          "parallel_tool_calls")
    parser = tool_call_parser if functions and forced is None and body.get(
        "tool_choice") != "none" else None
    if parser is not None and _constraint(body) is None:
        constraint = tool_constraint(parser, functions, None, single=not parallel)
        if constraint is not None:
            body[constraint[0]] = constraint[1]
    budget = _thinking_budget(body, reasoning_parser)
    thinking = bool(reasoning_parser) and thinking_enabled(reasoning_parser, template_kwargs)
    if HARMONY in (parser, reasoning_parser):
        # Harmony's channels and calls are marked by special tokens: the parsers read them.
        body["skip_special_tokens"] = False
    if reasoning_parser == HARMONY and (budget is not None or _constraint(body) is not None):
        raise RequestError(
            "thinking_budget and constrained answers (response_format, a required or named "
            "tool_choice, json_schema, regex, ebnf, structural_tag) are not supported with the "
            "gpt-oss reasoning parser", "reasoning_parser")
    if thinking and reasoning_parser != HARMONY:
        given = _constraint(body)
        reader = ReasoningParser(reasoning_parser, thinking=True)
        start = "" if reader.in_reasoning_at_start else "<think>"
        moved = grammar.after_reasoning(given, start, reader.end_tag, budget)
        if moved is not None:
            if given is not None:
                body[given[0]] = None
            body[moved[0]] = moved[1]
    separate = body.get("separate_reasoning", True)
    if not isinstance(separate, bool):
        raise RequestError(f"separate_reasoning must be a boolean, got {separate!r}",
                          "separate_reasoning")
    shape = AnswerShape(functions, forced, parser, reasoning_parser if separate else None,
                        thinking)
    if tools:
        template_kwargs["tools"] = tools
    return ChatSetup(shape, template_kwargs)


def _template_kwargs(body: Json) -> Json:
    raw = body.get("chat_template_kwargs")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise RequestError(f"chat_template_kwargs must be an object, got {raw!r}",
                          "chat_template_kwargs")
    taken = sorted(set(raw) & set(_TEMPLATE_ARGS))
    if taken:
        raise RequestError(f"chat_template_kwargs may not set {', '.join(taken)}",
                          "chat_template_kwargs")
    return dict(raw)


def _thinking_budget(body: Json, reasoning_parser: str | None) -> int | None:
    """The most tokens the model may think for (None: as many as it likes)."""
    budget = body.get("thinking_budget")
    if budget is None:
        return None
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise RequestError(f"thinking_budget must be an integer >= 0, got {budget!r}",
                           "thinking_budget")
    if reasoning_parser is None:
        raise RequestError("thinking_budget needs a server that parses reasoning "
                           "(reasoning_parser)", "thinking_budget")
    return budget


def _tools(raw: Any) -> tuple[list[Json], dict[str, Json]]:
    """The tools as the chat template takes them, and each function's parameters."""
    if raw is None:
        return [], {}
    if not isinstance(raw, list) or not raw:
        raise RequestError("tools must be a non-empty list of functions", "tools")
    functions: dict[str, Json] = {}
    for tool in raw:
        spec = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
            spec, dict
        ):
            raise RequestError(f"each tool must be {{'type': 'function', 'function': {{...}}}}, "
                              f"got {tool!r}", "tools")
        name, params = spec.get("name"), spec.get("parameters", _NO_PARAMETERS)
        if not isinstance(name, str) or not name:
            raise RequestError("every tool's function needs a name", "tools")
        if not isinstance(params, dict):
            raise RequestError(f"the parameters of tool {name!r} must be an object", "tools")
        try:
            grammar.check(("json_schema", json.dumps(params)), compile=False)
        except ValueError as exc:
            raise RequestError(f"the parameters of tool {name!r}: {exc}", "tools") from None
        functions[name] = params
    return raw, functions


def _tool_choice(body: Json, functions: Mapping[str, Json]) -> str | None:
    """The call a forced tool_choice asks for (see AnswerShape.forced); a forced call becomes
    a json_schema constraint on the whole output, written into the body: the function's
    parameters, or for `required` an object naming one of the functions with its arguments."""
    choice = body.get("tool_choice")
    if not functions:
        if choice not in (None, "none"):
            raise RequestError("tool_choice needs tools", "tool_choice")
        return None
    if choice is None or choice in ("auto", "none"):
        return None
    if choice == "required":
        schema: Json = {"anyOf": [
            {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
             "required": ["name", "arguments"]}
            for name, params in functions.items()
        ]}
        forced = ""
    else:
        named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if named not in functions:
            raise RequestError("tool_choice must be none, auto, required or "
                              f"{{'type': 'function', 'function': {{'name': ...}}}} naming one "
                              f"of the tools, got {choice!r}", "tool_choice")
        schema, forced = functions[named], named
    if _constraint(body) is not None:
        raise RequestError("a forced tool call leaves no room for response_format",
                          "tool_choice")
    body["json_schema"] = json.dumps(schema)
    return forced


def _constraint(body: Json) -> tuple[str, str] | None:
    """The output constraint the body carries so far, as (kind, text)."""
    for kind in GRAMMAR_KINDS:
        if body.get(kind) is not None:
            return kind, body[kind]
    return None


# ---- reading the answer back -------------------------------------------------------------------


@dataclass
class AnswerParts:
    """One choice's answer as OpenAI message fields: whole (`message`) or as stream deltas
    (`feed`, then `finish`). `called` says whether it called a tool."""

    shape: AnswerShape
    call_id: str  # the first call's id; later calls add their index
    called: bool = False
    _reasoning: ReasoningParser | HarmonyReasoning | None = field(default=None, init=False)
    _tools: ToolParser | None = field(default=None, init=False)
    _held: str = field(default="", init=False)  # a forced call's text, read at the end

    def __post_init__(self) -> None:
        shape = self.shape
        if shape.reasoning_parser is not None:
            self._reasoning = reasoning_parser(shape.reasoning_parser, shape.thinking)
        if shape.tool_parser is not None:
            self._tools = tool_parser(shape.tool_parser, shape.functions)

    @property
    def plain(self) -> bool:
        """Whether the answer is text as it comes (nothing to parse)."""
        return self._reasoning is None and self._tools is None and self.shape.forced is None

    def message(self, text: str) -> Json:
        """The assistant message of a whole answer."""
        message: Json = {"role": "assistant", "content": text}
        if self._reasoning is not None:
            reasoning, text = self._reasoning.parse(text)
            message["reasoning_content"] = reasoning
            message["content"] = text
        calls: list[ToolCall] = []
        if self.shape.forced is not None:
            call = self._forced_call(text)
            if call is not None:  # the whole answer is the call
                message["content"], calls = "", [call]
        elif self._tools is not None:
            message["content"], calls = self._tools.parse(text)
        if calls:
            self.called = True
            message["content"] = message["content"] or None
            message["tool_calls"] = [
                {"id": self._id(k), "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for k, c in enumerate(calls)
            ]
        return message

    def feed(self, text: str) -> list[Json]:
        """The deltas that `text`, the answer's next piece, makes safe to send."""
        if self._reasoning is None:
            return self._answer(text)
        piece = self._reasoning.feed(text)
        return _reasoning_delta(piece.reasoning) + self._answer(piece.content)

    def finish(self) -> list[Json]:
        """The deltas held back until the answer's end."""
        deltas: list[Json] = []
        if self._reasoning is not None:
            piece = self._reasoning.finish()
            deltas = _reasoning_delta(piece.reasoning) + self._answer(piece.content)
        if self.shape.forced is not None:
            call = self._forced_call(self._held)
            if call is None:  # cut before it named a function: what came is plain content
                return deltas + _content_delta(self._held)
            self.called = True
            return deltas + [{"tool_calls": [{
                "index": 0, "id": self._id(0), "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}]}]
        if self._tools is not None:
            deltas += self._tool_deltas(self._tools.finish())
        return deltas

    def _answer(self, text: str) -> list[Json]:
        if self.shape.forced is not None:
            self._held += text
            return []
        if self._tools is None:
            return _content_delta(text)
        return self._tool_deltas(self._tools.feed(text))

    def _tool_deltas(self, parsed: ParsedDelta) -> list[Json]:
        deltas = _content_delta(parsed.content)
        for call in parsed.calls:
            entry: Json = {"index": call.index, "function": {"arguments": call.arguments}}
            if call.name is not None:
                self.called = True
                entry = {"index": call.index, "id": self._id(call.index), "type": "function",
                         "function": {"name": call.name, "arguments": call.arguments}}
            deltas.append({"tool_calls": [entry]})
        return deltas

    def _forced_call(self, text: str) -> ToolCall | None:
        """The answer as the call a forced tool_choice asked for: a named function's
        arguments as generated (cut short under `length`); under `required` the output names
        the function, so a cut one may have no call at all."""
        if self.shape.forced:
            return ToolCall(self.shape.forced, text)
        try:
            picked = json.loads(text)
        except json.JSONDecodeError:
            return None
        return ToolCall(picked["name"], json.dumps(picked["arguments"]))

    def _id(self, k: int) -> str:
        return self.call_id if k == 0 else f"{self.call_id}_{k}"


def _reasoning_delta(text: str) -> list[Json]:
    return [{"reasoning_content": text}] if text else []


def _content_delta(text: str) -> list[Json]:
    return [{"content": text}] if text else []


# ---- SGLang's native parse routes ------------------------------------------------------------


def parse_function_call(body: Json) -> Json:
    """POST /parse_function_call: the tool calls in `text`, written in the format
    `tool_call_parser`, against `tools` (OpenAI's shape); each call names its tool's index."""
    text, kind = _text(body), body.get("tool_call_parser")
    _, functions = _tools(body.get("tools"))
    try:
        parser = tool_parser(kind, functions) if isinstance(kind, str) else None
    except ValueError as exc:
        raise RequestError(str(exc), "tool_call_parser") from None
    if parser is None:
        raise RequestError(f"tool_call_parser must be a string, got {kind!r}", "tool_call_parser")
    content, calls = parser.parse(text)
    index = {name: k for k, name in enumerate(functions)}
    return {"normal_text": content, "calls": [
        {"tool_index": index[c.name], "name": c.name, "parameters": c.arguments} for c in calls]}


def separate_reasoning(body: Json) -> Json:
    """POST /separate_reasoning: `text` split by the `reasoning_parser` named."""
    text, kind = _text(body), body.get("reasoning_parser")
    try:
        check_kind(kind)
    except (ValueError, TypeError):
        raise RequestError(f"reasoning_parser must name a reasoning parser, got {kind!r}",
                           "reasoning_parser") from None
    reasoning, content = reasoning_parser(kind).parse(text)
    return {"text": content, "reasoning_text": reasoning or ""}


def _text(body: Json) -> str:
    if not isinstance(body, dict) or not isinstance(body.get("text"), str):
        raise RequestError("the body must be a JSON object with a string text", "text")
    return body["text"]


# ---- chat messages, reduced to what a chat template renders ----------------------------------

# The roles a message may have, as the chat template knows them (a developer is a system).
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool"}


def chat_messages(raw: Any) -> list[dict[str, Any]]:
    """Check `messages` and return them as {"role", "content"} dicts with text content, plus
    an assistant turn's tool_calls (arguments as objects, as chat templates read them)."""
    if not isinstance(raw, list):
        raise RequestError(f"messages must be a list of messages, got {raw!r}", "messages")
    if not raw:
        raise RequestError("messages must not be empty", "messages")
    return [_message(i, message) for i, message in enumerate(raw)]


def _message(i: int, message: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be an object, got {message!r}", where)
    role = message.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise RequestError(
            f"{where}.role must be one of {', '.join(_ROLES)}; got {role!r}", f"{where}.role"
        )
    out: dict[str, Any] = {"role": _ROLES[role],
                           "content": _content(message.get("content"), role, where)}
    if role == "assistant" and message.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
    if role == "tool" and message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    """An earlier assistant turn's tool calls, their JSON arguments read into objects."""
    calls = []
    for call in raw if isinstance(raw, list) else [None]:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"{where} must be a list of {{'type': 'function', 'function': "
                              f"{{'name', 'arguments'}}}} calls, got {raw!r}", where)
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, ValueError):
            raise RequestError(f"{where}: the arguments of {function['name']!r} must be JSON "
                              f"text, got {function.get('arguments')!r}", where) from None
        calls.append({"id": call.get("id"), "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls


def _content(content: Any, role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    # An assistant turn that only called tools has null content.
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise RequestError(
            f"{where}.content must be a string or a list of text parts, got {content!r}",
            f"{where}.content",
        )
    texts = []
    for part in content:
        if not (
            isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ):
            raise RequestError(
                f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are "
                f"supported, got {part!r}",
                f"{where}.content",
            )
        texts.append(part["text"])
    # Parts are separate blocks to the client; a newline keeps their words apart.
    return "\n".join(texts)
