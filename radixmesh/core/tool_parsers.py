"""Tool-call parsers: the function calls an open model wrote into its answer, in the formats
of SGLang's `--tool-call-parser` (qwen25/qwen, llama3, mistral, pythonic). Pure text.

Each format (radixmesh.core.tool_formats) recognises one *unit* of call text (a `<tool_call>`
block, a `[TOOL_CALLS]` array, a `;`-separated run of Llama JSON objects, a Python list of
calls) and reports its calls as far as they have arrived (`Call`, `Unit`); this module's
driver turns the reports into content and calls, for a whole answer (`parse`) or
incrementally (`feed` ... `finish`).

- A call counts only if its text parses, names a function of `tools` and its arguments (a
  JSON object) validate against that function's schema; otherwise its text stays content.
  When a unit's first call fails, the whole unit is content.
- Content is the text around the calls, joined, without surrounding whitespace; what only
  separates calls (`;`, `,`, `]`, an end tag) belongs to the unit.

Streaming cannot take back what it emitted:
- Text that might open a call (a partial "<tool_call>" at the end) is held back until decided;
  so is trailing whitespace, shown only once more content follows it.
- A JSON call is committed once its name and the brace opening its arguments have arrived
  and the name is a known function. Its arguments then stream as the raw text the model
  writes (as OpenAI streams them), never the enclosing brace or end tag; `parse` returns them
  as compact `json.dumps` text instead, equal as JSON.
- An unknown name is seen before anything of its call is emitted, so the unit becomes content
  as in `parse`. A committed call stays a call: if its arguments then fail to parse or
  validate (or the answer is cut), the stream reports them as written where `parse` reports
  content. That is the one way the two disagree; neither depends on how the text was split.
- Calls that can only be judged whole (pythonic, or JSON whose "name" key does not come
  first) are emitted whole, name then compact JSON arguments, once their text closes.
"""

from __future__ import annotations

import copy
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from radixmesh.core.grammar import schema_validator

if TYPE_CHECKING:
    from jsonschema.protocols import Validator


@dataclass(frozen=True)
class ToolCall:
    """One function call found in an answer."""

    name: str
    arguments: str  # the arguments as compact JSON object text (json.dumps of the parsed object)


@dataclass(frozen=True)
class ToolCallDelta:
    """The next piece of one call of a streamed answer."""

    index: int  # which call of this answer (0, 1, ...)
    name: str | None  # set on the first delta of a call only
    arguments: str  # the next piece of the arguments' JSON text ("" allowed)


@dataclass(frozen=True)
class ParsedDelta:
    """What a stream can show after one `feed`: new content and new pieces of calls."""

    content: str
    calls: list[ToolCallDelta]


INVALID = object()  # arguments that did not parse
_WAIT, _REJECT, _DONE = "wait", "reject", "done"
# A JSON call whose name comes first can be committed before its arguments arrive.
_HEADER = re.compile(
    r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)


def skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return INVALID


class _Span:
    """Where a bracketed value opening at `start` closes. It resumes where it stopped, since a
    stream's text only grows: rescanning long arguments on every token would be quadratic."""

    def __init__(self, start: int, quotes: str) -> None:
        self.at = start
        self.depth = 0
        self.quote = ""
        self.quotes = quotes
        self.end: int | None = None

    def scan(self, text: str) -> int | None:
        while self.end is None and self.at < len(text):
            char = text[self.at]
            self.at += 1
            if self.quote:
                if char == "\\":
                    self.at += 1
                elif char == self.quote:
                    self.quote = ""
            elif char in self.quotes:
                self.quote = char
            elif char in "([{":
                self.depth += 1
            elif char in ")]}":
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.at
        return self.end


@dataclass
class Call:
    """One call's text inside a unit, as far as it has arrived (offsets into the unit)."""

    start: int
    name: str | None = None
    args_start: int | None = None  # set when the raw arguments can stream before the call ends
    args_end: int | None = None
    end: int | None = None  # set once the call's text is complete
    arguments: Any = INVALID  # the parsed arguments, once complete


@dataclass
class Unit:
    """The calls of a unit so far; `end` is None while more text could still extend it."""

    calls: list[Call]
    end: int | None


class ToolParser(ABC):
    """One answer's parser: `parse` for a whole answer, or `feed`...`finish` for a stream."""

    name: ClassVar[str]
    trigger: ClassVar[str | None]  # the text that opens a call, None where a call has none
    _opener: ClassVar[str]  # the text a unit starts with, searched for in the content

    def __init__(self, tools: Mapping[str, Mapping[str, Any]]) -> None:
        self._validators: dict[str, Validator] = {}
        for function, schema in tools.items():
            try:
                self._validators[function] = schema_validator(json.dumps(schema, sort_keys=True))
            except ValueError as error:
                raise ValueError(
                    f"tool {function!r}: invalid parameters schema: {error}"
                ) from error
        self._reset(eager=True)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content (text around the calls, stripped) and the calls of a whole answer."""
        whole = copy.copy(self)
        whole._reset(eager=False)
        whole._buffer = text
        delta = whole._advance(final=True)
        # Judging only complete calls, the driver emits each call as one delta.
        return delta.content, [
            ToolCall(call.name, call.arguments) for call in delta.calls if call.name is not None
        ]

    def feed(self, text: str) -> ParsedDelta:
        """The content and call pieces that the next piece of the answer makes safe to show."""
        self._buffer += text
        return self._advance(final=False)

    def finish(self) -> ParsedDelta:
        """Flush what was held back: the answer is complete."""
        return self._advance(final=True)

    @classmethod
    def structure(cls, name: str) -> tuple[str, str] | None:
        """(begin, end) text wrapping one call's arguments JSON, for constraining a call to the
        tool's schema; None when the format cannot be constrained that way."""
        return None

    @abstractmethod
    def _scan(self, text: str, final: bool) -> Unit | None:
        """The unit that `text` starts with, or None when no call starts there. With `final`
        no more text comes, so the unit's end is known."""

    def _find(self, text: str, fresh: bool) -> int | None:
        """Where the first unit may start; `fresh` while no content has been shown."""
        at = text.find(self._opener)
        return None if at < 0 else at

    def _hold(self, text: str) -> int:
        """How much of the end of `text` may be the start of a unit."""
        for size in range(min(len(text), len(self._opener) - 1), 0, -1):
            if text.endswith(self._opener[:size]):
                return size
        return 0

    def _reset(self, eager: bool) -> None:
        self._eager = eager  # commit JSON calls on their name (streaming) or only whole (parse)
        self._buffer = ""  # text not yet decided, starting at the active unit if any
        self._active = False
        self._spoken = False  # non-whitespace content was shown
        self._space = ""  # whitespace after the last content shown, held until more follows
        self._count = 0  # calls emitted
        self._done = 0  # calls of the active unit handled
        self._open = False  # the last named call's raw arguments are still streaming
        self._sent = 0  # characters of those arguments emitted
        self._spans: dict[int, _Span] = {}
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []

    def _advance(self, final: bool) -> ParsedDelta:
        self._content, self._deltas = [], []
        while self._buffer:
            if not self._active:
                at = self._find(self._buffer, not self._spoken)
                if at is None:
                    cut = len(self._buffer) - (0 if final else self._hold(self._buffer))
                    self._say(self._buffer[:cut])
                    self._consume(cut)
                    break
                self._say(self._buffer[:at])
                self._consume(at)
                self._active = True
            unit = self._scan(self._buffer, final)
            outcome = _REJECT if unit is None else self._run(unit, final)
            if outcome == _WAIT:
                break
            if outcome == _REJECT:
                # Not a call here: its first character is content; look again after it.
                self._say(self._buffer[0])
                self._consume(1)
        return ParsedDelta("".join(self._content), self._deltas)

    def _run(self, unit: Unit, final: bool) -> str:
        """Emit what the active unit's calls have decided; consume the unit once it ends."""
        text = self._buffer
        while self._done < len(unit.calls):
            call = unit.calls[self._done]
            if not self._open:
                verdict = self._verdict(call)
                if verdict is None and not final:
                    return _WAIT
                if not verdict:
                    if self._done == 0:
                        return _REJECT
                    if call.end is None and not final:
                        return _WAIT
                    self._say(text[call.start : call.end or len(text)])
                    self._done += 1
                    continue
                self._name(call)
            if self._open:
                assert call.args_start is not None  # only raw-streaming calls stay open
                stop = len(text) if call.args_end is None else call.args_end
                self._send(text[call.args_start + self._sent : stop])
                if call.args_end is None and not final:
                    return _WAIT
                self._open = False
            self._done += 1
        if unit.end is None and not final:
            return _WAIT
        self._consume(len(text) if unit.end is None else unit.end)
        return _DONE

    def _verdict(self, call: Call) -> bool | None:
        """Whether `call` is a call; None while that is not known yet."""
        if self._eager and call.args_start is not None:
            return call.name in self._validators
        if call.end is None:
            return None
        validator = self._validators.get(call.name or "")
        return (
            validator is not None
            and isinstance(call.arguments, dict)
            and validator.is_valid(call.arguments)
        )

    def _name(self, call: Call) -> None:
        assert call.name is not None  # a call judged valid has a name
        if self._eager and call.args_start is not None:
            self._deltas.append(ToolCallDelta(self._count, call.name, ""))
            self._open, self._sent = True, 0
        else:
            self._deltas.append(ToolCallDelta(self._count, call.name, json.dumps(call.arguments)))
        self._count += 1

    def _send(self, piece: str) -> None:
        if not piece:
            return
        self._sent += len(piece)
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.index == self._count - 1:
            self._deltas[-1] = replace(last, arguments=last.arguments + piece)
        else:
            self._deltas.append(ToolCallDelta(self._count - 1, None, piece))

    def _say(self, text: str) -> None:
        head = text.rstrip()
        if head:
            self._content.append(self._space + head if self._spoken else head.lstrip())
            self._spoken = True
            self._space = text[len(head) :]
        elif self._spoken:
            self._space += text

    def _consume(self, size: int) -> None:
        self._buffer = self._buffer[size:]
        self._active, self._done, self._open, self._sent = False, 0, False, 0
        self._spans.clear()

    def _span(self, text: str, start: int, quotes: str = '"') -> int | None:
        span = self._spans.get(start)
        if span is None:
            span = self._spans[start] = _Span(start, quotes)
        return span.scan(text)

    def _sequence(
        self,
        text: str,
        at: int,
        final: bool,
        element: Callable[[str, int], Call | None],
        separator: str,
        close: str,
    ) -> Unit | None:
        """Calls read by `element`, split by `separator`, up to `close` (both may be empty).
        Text that does not continue the sequence ends the unit after its last call."""
        calls: list[Call] = []
        while True:
            at = skip_space(text, at)
            if at == len(text) and not final:
                return Unit(calls, None)
            call = element(text, at)
            if call is None:
                break
            calls.append(call)
            if call.end is None:
                return Unit(calls, len(text) if final else None)
            at = skip_space(text, call.end)
            if close and text.startswith(close, at):
                return Unit(calls, at + len(close))
            if separator and text.startswith(separator, at):
                at += len(separator)
                continue
            marks = [mark for mark in (close, separator) if mark]
            if not final and any(mark.startswith(text[at : at + len(mark)]) for mark in marks):
                return Unit(calls, None)
            return Unit(calls, call.end)
        return Unit(calls, calls[-1].end) if calls else None

    def _json_call(self, text: str, at: int) -> Call | None:
        """A `{"name": ..., "arguments"|"parameters": {...}}` object starting at `at`."""
        if not text.startswith("{", at):
            return None
        first = skip_space(text, at + 1)
        if first < len(text) and text[first] not in '"}':
            return None
        call = Call(at)
        header = _HEADER.match(text, at)
        name = loads(header.group(1)) if header else None
        if header and isinstance(name, str):
            call.name, call.args_start = name, header.end()
            call.args_end = self._span(text, header.end())
        call.end = self._span(text, at)
        if call.end is not None:
            whole = loads(text[at : call.end])
            if isinstance(whole, dict) and isinstance(whole.get("name"), str):
                call.name = whole["name"]
                # A function without parameters may be called without an arguments key.
                call.arguments = whole.get("arguments", whole.get("parameters", {}))
        return call
