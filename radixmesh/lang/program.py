"""What a program appends to its state: text, `gen`, `select` and role markers, chained
with `+` into a Seq."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ToolChoice = str | Mapping[str, Any]


@dataclass(frozen=True)
class Tools:
    """The tools a `gen` may call: OpenAI-style tool dicts, how the model is made to call
    them (`choice`: "auto", "required", "none" or {"type": "function", "function":
    {"name": ...}}) and which parser reads its calls (a radixmesh.core.tool_parsers kind)."""

    specs: tuple[Mapping[str, Any], ...]
    choice: ToolChoice = "auto"
    parser: str = "qwen25"

    def schemas(self) -> dict[str, Mapping[str, Any]]:
        """Each tool's name -> its parameters' JSON schema."""
        out: dict[str, Mapping[str, Any]] = {}
        for spec in self.specs:
            fn = spec.get("function", spec)
            name = fn.get("name")
            if not isinstance(name, str) or not name:
                raise ValueError(f"a tool needs a function name: {spec!r}")
            out[name] = fn.get("parameters") or {"type": "object", "properties": {}}
        return out

    def required(self) -> str | None:
        """The choice as tool_constraint takes it: None (auto), "" (any tool) or a name."""
        choice = self.choice
        if choice == "auto":
            return None
        if choice == "required":
            return ""
        if isinstance(choice, Mapping):
            name = choice.get("function", {}).get("name")
            if name not in self.schemas():
                raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
            return name
        raise ValueError(f"tool_choice must be auto, required, none or a function, got {choice!r}")


@dataclass(frozen=True)
class Gen:
    """`gen(...)`: generate into the variable `name` (or pick among `choices`)."""

    name: str
    params: dict[str, Any]
    choices: tuple[str, ...] = ()
    tools: Tools | None = None

    def __add__(self, other: Part | Seq) -> Seq:
        return Seq((self, *_items(other)))

    def __radd__(self, other: str) -> Seq:
        return Seq((other, self))


@dataclass(frozen=True)
class RoleMark:
    """Where a role's message begins or ends; `tools` go to the template with it."""

    role: str
    begin: bool
    tools: tuple[Mapping[str, Any], ...] | None = field(default=None, compare=False)

    def __add__(self, other: Part | Seq) -> Seq:
        return Seq((self, *_items(other)))

    def __radd__(self, other: str) -> Seq:
        return Seq((other, self))


Part = str | Gen | RoleMark


@dataclass(frozen=True)
class Seq:
    """Parts in order: `"Answer: " + gen("x")`."""

    items: tuple[Part, ...]

    def __add__(self, other: Part | Seq) -> Seq:
        return Seq(self.items + _items(other))

    def __radd__(self, other: str) -> Seq:
        return Seq((other, *self.items))


def _items(part: Part | Seq) -> tuple[Part, ...]:
    return part.items if isinstance(part, Seq) else (part,)


def gen(
    name: str,
    max_tokens: int = 128,
    stop: str | Sequence[str] | None = None,
    temperature: float = 0.0,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
    choices: Sequence[str] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: ToolChoice = "auto",
    tool_call_parser: str = "qwen25",
) -> Gen:
    """Generate text into `name`: up to `max_tokens`, until a `stop` string, held to a
    `regex` or a `json_schema`, or picked among `choices` (as select does). With `tools`,
    the output is read for calls by `tool_call_parser`: `s[name]` is the text around
    them and `s.tool_calls(name)` the calls; `tool_choice` "required" or a function
    constrains the output to call one."""
    params: dict[str, Any] = {"max_new_tokens": max_tokens, "temperature": temperature}
    if stop is not None:
        params["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if regex is not None:
        params["regex"] = regex
    if json_schema is not None:
        params["json_schema"] = (
            json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        )
    spec = None
    if tools and tool_choice != "none":
        spec = Tools(tuple(tools), tool_choice, tool_call_parser)
        spec.required()  # a bad choice fails where it is written, not in the run
    return Gen(name, params, tuple(choices or ()), spec)


def select(name: str, choices: Sequence[str]) -> Gen:
    """Pick one of `choices` into `name`: the one whose tokens the model finds likeliest
    after the prompt so far, by their mean token logprob (SGLang's length-normalized
    score), all choices scored in one batch."""
    if not choices:
        raise ValueError("select needs at least one choice")
    return Gen(name, {}, tuple(choices))


def role(name: str, content: Part | Seq = "",
         tools: Sequence[Mapping[str, Any]] | None = None) -> Seq:
    """A message of role `name` around `content` (text, gens, selects), rendered with the
    backend's chat template; `tools` are rendered into the conversation by the template
    (most put them in the system part, so give them with the first message)."""
    marks = tuple(tools) if tools is not None else None
    return Seq((RoleMark(name, True, marks), *_items(content), RoleMark(name, False)))


def system(content: Part | Seq = "", tools: Sequence[Mapping[str, Any]] | None = None) -> Seq:
    """A system message."""
    return role("system", content, tools)


def user(content: Part | Seq = "", tools: Sequence[Mapping[str, Any]] | None = None) -> Seq:
    """A user message."""
    return role("user", content, tools)


def assistant(content: Part | Seq = "") -> Seq:
    """An assistant message: its prefix is the template's generation prompt."""
    return role("assistant", content)


def system_begin(tools: Sequence[Mapping[str, Any]] | None = None) -> RoleMark:
    return RoleMark("system", True, tuple(tools) if tools is not None else None)


def system_end() -> RoleMark:
    return RoleMark("system", False)


def user_begin(tools: Sequence[Mapping[str, Any]] | None = None) -> RoleMark:
    return RoleMark("user", True, tuple(tools) if tools is not None else None)


def user_end() -> RoleMark:
    return RoleMark("user", False)


def assistant_begin() -> RoleMark:
    return RoleMark("assistant", True)


def assistant_end() -> RoleMark:
    return RoleMark("assistant", False)
