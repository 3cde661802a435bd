"""Tool calls inside `gen`: the constraint that makes the model call a tool when the
program requires one, and reading the calls out of what it generated. Both come from
radixmesh.core.tool_parsers, so a program parses calls exactly as the chat API does."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixmesh.core.sampling_params import GRAMMAR_KINDS
from radixmesh.lang.program import Tools

if TYPE_CHECKING:
    from radixmesh.core.tool_parsers import ToolCall
else:
    ToolCall = Any


def tool_params(params: dict[str, Any], tools: Tools | None) -> dict[str, Any]:
    """The sampling params of a gen, with the grammar its tool_choice calls for: under auto
    a call the model opens is held to its tool's schema; under required (or a named
    function) the model must call."""
    if tools is None:
        return params
    from radixmesh.core.tool_formats import tool_constraint

    required = tools.required()
    constraint = tool_constraint(tools.parser, tools.schemas(), required)
    if constraint is None:
        return params
    if any(k in params for k in GRAMMAR_KINDS):
        if required is not None:
            raise ValueError("a gen that must call a tool takes no other constraint")
        return params  # auto: the gen's own constraint stands, as on the chat route
    kind, grammar = constraint
    return {**params, kind: grammar}


def read_calls(text: str, tools: Tools | None) -> tuple[str, list[ToolCall]]:
    """The text around the tool calls in `text`, and the calls."""
    if tools is None:
        return text, []
    from radixmesh.core.tool_formats import tool_parser

    content, calls = tool_parser(tools.parser, tools.schemas()).parse(text)
    return content, list(calls)
