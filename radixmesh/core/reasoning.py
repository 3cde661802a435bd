"""Reasoning parsers (SGLang's `--reasoning-parser`): split a reasoning model's answer into
its thinking, written between `<think>` and `</think>`, and the answer proper.

Kinds differ in who opens the block. Qwen3 writes `<think>` itself when thinking is on, so
an answer that does not begin with it has no reasoning. DeepSeek-R1, DeepSeek-V3 (with
thinking on) and the Qwen3 thinking-only models are prompted with the block already open:
their text is reasoning up to `</think>`, all of it when the answer is cut before the tag;
an echoed `<think>` at the start is dropped. The whitespace right around the tags goes with
them; an answer that never enters a reasoning block is returned exactly as written.

gpt-oss (`gpt-oss`) writes harmony messages instead (radixmesh.core.harmony): its reasoning
is the text of its `analysis` messages, its answer the text of the others. A tool call's
message stays in the answer as harmony text, for the gpt-oss tool-call parser to read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

from radixmesh.core.harmony import CALL, HarmonyReader, Piece

_OPEN = "<think>"
_CLOSE = "</think>"


@dataclass(frozen=True)
class _Kind:
    """How one model family marks its thinking and how a request turns it on or off."""

    prompt_opens: bool  # the chat template ends the prompt inside the reasoning block
    switch: str | None  # the chat_template_kwargs key that turns thinking on or off
    default_on: bool


_KINDS: dict[str, _Kind] = {
    "deepseek-r1": _Kind(prompt_opens=True, switch=None, default_on=True),
    "deepseek-v3": _Kind(prompt_opens=True, switch="thinking", default_on=False),
    "qwen3": _Kind(prompt_opens=False, switch="enable_thinking", default_on=True),
    "qwen3-thinking": _Kind(prompt_opens=True, switch=None, default_on=True),
}
THINK_TAG_PARSERS: tuple[str, ...] = tuple(_KINDS)
HARMONY = "gpt-oss"
REASONING_PARSERS: tuple[str, ...] = (*THINK_TAG_PARSERS, HARMONY)


def check_kind(kind: str) -> None:
    """Raise ValueError unless `kind` names a known reasoning parser."""
    if kind not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {kind!r}; known: {', '.join(REASONING_PARSERS)}"
        )


def thinking_enabled(kind: str, chat_template_kwargs: Mapping[str, Any]) -> bool:
    """Whether a request with these chat_template_kwargs has the model think."""
    check_kind(kind)
    spec = _KINDS.get(kind)
    if spec is None or spec.switch is None:  # gpt-oss always reasons (reasoning_effort: how much)
        return True
    value = chat_template_kwargs.get(spec.switch)
    # As the chat templates read it: a default-on switch is turned off only by a literal
    # false, a default-off one turned on only by a literal true.
    return value is not False if spec.default_on else value is True


@dataclass(frozen=True)
class ReasoningDelta:
    """What one streamed piece of an answer adds to the reasoning and to the content."""

    reasoning: str
    content: str


class _Phase(Enum):
    START = auto()  # not yet known whether the answer opens with `<think>`
    REASONING = auto()
    ANSWER_LEAD = auto()  # after `</think>`, dropping the whitespace before the answer
    ANSWER = auto()


def _undecided_tail(text: str) -> int:
    """Length of the end of `text` that may still be whitespace before `</think>`."""
    partial = next(
        (n for n in range(min(len(text), len(_CLOSE) - 1), 0, -1) if text.endswith(_CLOSE[:n])),
        0,
    )
    body = text[: len(text) - partial]
    return partial + len(body) - len(body.rstrip())


class ReasoningParser:
    """One answer's parser, for the kinds that write `<think>` blocks."""

    def __init__(self, kind: str, thinking: bool = True) -> None:
        check_kind(kind)
        if kind not in _KINDS:
            raise ValueError(f"{kind!r} is not a reasoning parser of <think> blocks")
        self._in_reasoning_at_start = thinking and _KINDS[kind].prompt_opens
        self._phase = _Phase.START if thinking else _Phase.ANSWER
        self._thinking = thinking
        self._held = ""
        self._said_reasoning = False

    @property
    def end_tag(self) -> str:
        """The tag after which the answer proper begins."""
        return _CLOSE

    @property
    def in_reasoning_at_start(self) -> bool:
        """Whether the answer starts inside the reasoning without writing `<think>`."""
        return self._in_reasoning_at_start

    def parse(self, text: str) -> tuple[str | None, str]:
        """(reasoning, or None when there was none; content) of a whole answer."""
        if not self._thinking:
            return None, text
        body = text.lstrip()
        if body.startswith(_OPEN):
            body = body[len(_OPEN) :]
        elif not self._in_reasoning_at_start:
            return None, text
        reasoning, _, content = body.partition(_CLOSE)
        return reasoning.strip() or None, content.lstrip()

    def feed(self, text: str) -> ReasoningDelta:
        """The next piece of the answer; holds back what may still be part of a tag."""
        self._held += text
        reasoning = content = ""
        if self._phase is _Phase.START:
            lead = self._held.lstrip()
            if len(lead) < len(_OPEN) and _OPEN.startswith(lead):
                return ReasoningDelta("", "")
            if lead.startswith(_OPEN):
                self._held = lead[len(_OPEN) :]
                self._phase = _Phase.REASONING
            else:
                self._phase = _Phase.REASONING if self._in_reasoning_at_start else _Phase.ANSWER
        if self._phase is _Phase.REASONING:
            if not self._said_reasoning:
                self._held = self._held.lstrip()
            end = self._held.find(_CLOSE)
            if end >= 0:
                reasoning = self._held[:end].rstrip()
                self._held = self._held[end + len(_CLOSE) :]
                self._phase = _Phase.ANSWER_LEAD
            else:
                cut = len(self._held) - _undecided_tail(self._held)
                reasoning, self._held = self._held[:cut], self._held[cut:]
            self._said_reasoning = self._said_reasoning or bool(reasoning)
        if self._phase is _Phase.ANSWER_LEAD:
            self._held = self._held.lstrip()
            if self._held:
                self._phase = _Phase.ANSWER
        if self._phase is _Phase.ANSWER:
            content, self._held = self._held, ""
        return ReasoningDelta(reasoning, content)

    def finish(self) -> ReasoningDelta:
        """What was held back, once the answer has ended (finished or cut off)."""
        held, self._held = self._held, ""
        if self._phase is _Phase.START:
            if self._in_reasoning_at_start:
                return ReasoningDelta(held.strip(), "")
            return ReasoningDelta("", held)
        if self._phase is _Phase.REASONING:
            return ReasoningDelta(held.rstrip(), "")
        return ReasoningDelta("", "")


class HarmonyReasoning:
    """One gpt-oss answer's parser: `analysis` messages are reasoning; `final` messages,
    commentary for the user and text outside the format are content; a tool call's message
    goes to the content as harmony text (header, arguments, `<|call|>`). Messages of the same
    kind are joined by a blank line."""

    in_reasoning_at_start = False

    def __init__(self) -> None:
        self._reader = HarmonyReader()
        self._said = {True: False, False: False}  # reasoning / content had text
        self._apart = {True: False, False: False}  # a new message opened after that text

    def parse(self, text: str) -> tuple[str | None, str]:
        """(reasoning, or None when there was none; content) of a whole answer."""
        parser = HarmonyReasoning()
        first, rest = parser.feed(text), parser.finish()
        reasoning = first.reasoning + rest.reasoning
        return reasoning or None, first.content + rest.content

    def feed(self, text: str) -> ReasoningDelta:
        """The next piece of the answer; holds back what may still be part of a marker."""
        return self._deltas(self._reader.feed(text))

    def finish(self) -> ReasoningDelta:
        """What was held back, once the answer has ended."""
        return self._deltas(self._reader.finish())

    def _deltas(self, pieces: list[Piece]) -> ReasoningDelta:
        out: dict[bool, list[str]] = {True: [], False: []}
        for piece in pieces:
            if piece.header.function is not None:
                out[False].append(
                    (piece.header.render() if piece.opens else "") + piece.text
                    + (CALL if piece.closes else ""))
                continue
            reasoning = piece.header.channel == "analysis"
            if piece.opens and self._said[reasoning]:
                self._apart[reasoning] = True
            if piece.text:
                if self._apart[reasoning]:
                    out[reasoning].append("\n\n")
                    self._apart[reasoning] = False
                out[reasoning].append(piece.text)
                self._said[reasoning] = True
        return ReasoningDelta("".join(out[True]), "".join(out[False]))


def reasoning_parser(kind: str, thinking: bool = True) -> ReasoningParser | HarmonyReasoning:
    """One answer's parser for the `--reasoning-parser` named `kind`."""
    check_kind(kind)
    return HarmonyReasoning() if kind == HARMONY else ReasoningParser(kind, thinking)
