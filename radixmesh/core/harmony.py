"""gpt-oss's harmony format, read as the model writes it: an answer is a run of messages, each
a header and a body. The chat template ends the prompt with `<|start|>assistant`, so the answer
opens with the first message's header (a call's header is cut in two here, to fit):

    <|channel|>analysis<|message|>Thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
        <|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>The answer.<|return|>

A header names the message's channel (`analysis`: reasoning; `commentary`: a preamble for
the user, or a tool call when it names a recipient `to=functions.NAME`, which may also come
before the channel; `final`: the answer) and its content type (`<|constrain|>json`, or a
bare `json` after the channel). A body ends at `<|end|>`, `<|call|>` or `<|return|>` (the
last two are stop tokens, so usually the answer just ends). The markers are special tokens:
they reach this reader only when the request keeps special tokens in its text.

`HarmonyReader` reads an answer piece by piece (a stream's text only grows) and reports each
message's body as it arrives, holding back what may be the start of a marker. An answer that
does not open with a header (a model that ignores the format) is one message without a
channel, read as the answer; so is a header that never reaches its `<|message|>`."""

from __future__ import annotations

import re
from dataclasses import dataclass

START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
RETURN = "<|return|>"
CALL = "<|call|>"
_BODY_ENDS = (END, CALL, RETURN, START)
_MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
_HEADER_STARTS = (START, CHANNEL, "to=")  # what a header may open with
FUNCTIONS = "functions."  # the recipient prefix of a tool call

_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_CONSTRAIN = re.compile(re.escape(CONSTRAIN) + r"\s*([^\s<]+)")
_BARE_TYPE = re.compile(re.escape(CHANNEL) + r"\s*[^\s<]+(?:\s+to=[^\s<]+)?\s+([^\s<=]+)\s*$")


@dataclass
class Header:
    """What a message's header says."""

    channel: str = ""  # "analysis", "commentary", "final"; "" when it names none
    recipient: str = ""  # "functions.NAME" for a tool call; "" when none
    content_type: str = ""  # "json" and the like; "" when none

    @property
    def function(self) -> str | None:
        """The function a tool call names; None for any other message."""
        if self.recipient.startswith(FUNCTIONS):
            return self.recipient[len(FUNCTIONS):]
        return None

    def render(self) -> str:
        """The header as the model writes it, from `<|channel|>` to `<|message|>`."""
        text = f"{CHANNEL}{self.channel}"
        if self.recipient:
            text += f" to={self.recipient}"
        if self.content_type:
            text += f" {CONSTRAIN}{self.content_type}"
        return text + MESSAGE


def read_header(text: str) -> Header:
    """The header whose text (everything before its `<|message|>`) is `text`."""
    recipient = _RECIPIENT.search(text)
    channel = _CHANNEL.search(text)
    content_type = _CONSTRAIN.search(text) or _BARE_TYPE.search(text)
    return Header(
        channel.group(1) if channel else "",
        recipient.group(1) if recipient else "",
        content_type.group(1) if content_type else "",
    )


def marker_tail(text: str) -> int:
    """Length of the end of `text` that may be the start of a marker (not a whole one)."""
    at = text.rfind("<", max(0, len(text) - max(map(len, _MARKERS)) + 1))
    while at >= 0:
        tail = text[at:]
        if any(marker.startswith(tail) and marker != tail for marker in _MARKERS):
            return len(tail)
        at = text.find("<", at + 1)
    return 0


@dataclass(frozen=True)
class Piece:
    """Part of one message's body; `opens` on its message's first piece, `closes` on its
    last (an empty piece may open or close a message)."""

    index: int  # which message of the answer (0, 1, ...)
    header: Header
    text: str
    opens: bool = False
    closes: bool = False


class HarmonyReader:
    """One answer's messages, read as its text arrives (`feed`, then `finish`)."""

    def __init__(self) -> None:
        self._buffer = ""
        self._header: Header | None = None  # the message whose body is being read
        self._index = -1

    def feed(self, text: str) -> list[Piece]:
        """The body pieces that the answer's next piece of text makes certain."""
        self._buffer += text
        return self._advance(final=False)

    def finish(self) -> list[Piece]:
        """The rest: the answer has ended (finished or cut off)."""
        pieces = self._advance(final=True)
        if self._header is not None:  # cut (or stopped) inside a body: that message ends
            pieces.append(Piece(self._index, self._header, "", closes=True))
            self._header = None
        return pieces

    def _advance(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        while self._buffer:
            if self._header is None:
                if not self._open_message(final, pieces):
                    break
                continue
            ends = [(at, m) for m in _BODY_ENDS if (at := self._buffer.find(m)) >= 0]
            if not ends:
                cut = len(self._buffer) - (0 if final else marker_tail(self._buffer))
                if cut:
                    pieces.append(Piece(self._index, self._header, self._buffer[:cut]))
                    self._buffer = self._buffer[cut:]
                break
            at, marker = min(ends)
            pieces.append(Piece(self._index, self._header, self._buffer[:at], closes=True))
            # A new message's `<|start|>` belongs to its header.
            self._buffer = self._buffer[at + (0 if marker == START else len(marker)):]
            self._header = None
        return pieces

    def _open_message(self, final: bool, pieces: list[Piece]) -> bool:
        """Read the next header off the buffer; False while it has not all arrived."""
        lead = self._buffer.lstrip()
        if lead and not any(m.startswith(lead[: len(m)]) for m in _HEADER_STARTS):
            # Text where a header belongs (a model that ignores the format): a message
            # without a channel, read as the answer.
            self._start(Header(), pieces)
            return True
        at = self._buffer.find(MESSAGE)
        if at < 0:
            if not final:
                return False
            # A header that never reached `<|message|>` (cut short, or a model that does not
            # keep to the format): said as text, never dropped.
            self._start(Header(), pieces)
            assert self._header is not None
            pieces.append(Piece(self._index, self._header, self._buffer, closes=True))
            self._buffer, self._header = "", None
            return True
        self._start(read_header(self._buffer[:at]), pieces)
        self._buffer = self._buffer[at + len(MESSAGE):]
        return True

    def _start(self, header: Header, pieces: list[Piece]) -> None:
        self._index += 1
        self._header = header
        pieces.append(Piece(self._index, header, "", opens=True))
