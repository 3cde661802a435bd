"""Stateless detokenization: the text of an update's new ids, computed from a bounded window
of the ids before them, the same whichever replica computes it and however the request's
tokens were split into updates.

Every update's text is a difference of one function of the request's tokens: the text
released once output token k exists. Before stop strings, that is the decoded text up to
the last token boundary (at most `MAX_PENDING_TOKENS` back) where the text ends in a whole
character, so a token whose bytes end inside a character waits, with the rest of its text,
for the bytes that complete it, as `IncrementalDetokenizer` does. From the first token past
min_new_tokens on, a suffix that may begin a stop string is held back too, and the first
stop string to complete ends the text. A finished request releases everything held back.

UTF-8 resynchronizes within a character, so decoding from a few bytes too early gives the
same text after that point as decoding the whole request: a window of
`detok_context_size` ids is enough.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

REPLACEMENT_CHAR = "\ufffd"
# Valid text never keeps more than 4 tokens pending (one per byte of a character); a longer
# run of incomplete tails means invalid bytes, which are released once they are settled.
MAX_PENDING_TOKENS = 8


class DecodeFn(Protocol):
    """Decodes token ids to text, e.g. `tokenizers.Tokenizer.decode`."""

    def __call__(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...


class StopResult(NamedTuple):
    """Text safe to release now, and the stop string that ended the stream, if any."""

    text: str
    matched: str | None


class StopStringMatcher:
    """Releases streamed text while holding back anything that may begin a stop string."""

    def __init__(self, stops: Sequence[str], no_stop_trim: bool = False) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._no_stop_trim = no_stop_trim
        self._prefixes = {stop[:n] for stop in self._stops for n in range(1, len(stop))}
        self._max_held = max((len(stop) - 1 for stop in self._stops), default=0)
        self._held = ""
        self.matched: str | None = None

    def feed(self, delta: str) -> StopResult:
        """Consumes a delta; after a stop has matched, further text is dropped."""
        if self.matched is not None:
            return StopResult("", None)
        # Released text never holds the start of a stop, so every match lies in this buffer.
        buffer = self._held + delta
        # Decide as soon as any stop is complete, so generation halts at once; a longer stop
        # that began earlier but is still incomplete does not delay the decision.
        match = self._first_match(buffer)
        if match is not None:
            start, stop = match
            self.matched = stop
            self._held = ""
            end = start + len(stop) if self._no_stop_trim else start
            return StopResult(buffer[:end], stop)
        keep = self._partial_stop_len(buffer)
        self._held = buffer[len(buffer) - keep :]
        return StopResult(buffer[: len(buffer) - keep], None)

    def flush(self) -> str:
        """Returns the held-back text at the end of the stream."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        """Returns the earliest stop occurrence; the longest stop wins a tie."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            start = buffer.find(stop)
            if start < 0:
                continue
            if best is None or (start, -len(stop)) < (best[0], -len(best[1])):
                best = (start, stop)
        return best

    def _partial_stop_len(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop."""
        for n in range(min(len(buffer), self._max_held), 0, -1):
            if buffer[-n:] in self._prefixes:
                return n
        return 0


# A window may start inside a character: up to 3 of its continuation bytes decode as
# replacement characters before the decoder is back in step with the whole text, so the
# window needs one more byte to see the whole text's last character.
_RESYNC_BYTES = 4
# Skipped special tokens carry no bytes; room for a few of them inside the window.
_SKIPPED_SPECIALS = 8


def detok_context_size(stop: Sequence[str]) -> int:
    """Ids of left context each update needs so that any replica decodes it exactly."""
    # The text released before the new ids ends at a boundary at most MAX_PENDING_TOKENS back. A
    # stop string that completes after it began at most len(stop) - 1 characters, so at most
    # len(stop.encode()) - 1 bytes, earlier, and the window must reach _RESYNC_BYTES further
    # back to be in step with the whole text there. Every token but a skipped special token
    # carries at least one byte.
    longest = max((len(s.encode()) for s in stop), default=0)
    return longest + _RESYNC_BYTES + MAX_PENDING_TOKENS + _SKIPPED_SPECIALS


@dataclass(frozen=True)
class TextRules:
    """What shapes a request's text besides its tokens."""

    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    min_new_tokens: int = 0


class Update(NamedTuple):
    """One update of a request: new output ids and the ids right before them."""

    context: Sequence[int]  # up to detok_context_size ids before `new`: prompt, then output
    new: Sequence[int]
    offset: int  # output tokens before `new`
    finished: bool  # the request ends with `new`: release everything held back
    trim_last: bool = False  # the last new id is a matched stop token shown without text
    prompt_tail: Sequence[int] = ()  # last prompt ids, used when `context` holds no prompt


class WindowText(NamedTuple):
    """The text of an update's new ids and the stop string that ended the request, if any."""

    text: str
    # Output tokens up to and including the one that completed the stop string; it lies
    # before the update's new ids when the request had stopped already.
    stop_at: int | None = None
    matched: str | None = None


def window_text(decode: DecodeFn, rules: TextRules, update: Update) -> WindowText:
    """The text the update adds to the request's output, stop strings applied."""
    return _Window(decode, rules, update).result()


class _Window:
    """The token boundaries of one update's window and the text released at each."""

    # Boundary j follows the window's first j ids; end + 1 stands for the finish.

    def __init__(self, decode: DecodeFn, rules: TextRules, update: Update) -> None:
        self._decode = decode
        self._skip_special_tokens = rules.skip_special_tokens
        self._stops = tuple(stop for stop in rules.stop if stop)
        self._no_stop_trim = rules.no_stop_trim
        left = list(update.context)
        # A context of exactly the output so far reaches the prompt, whose tail precedes it.
        if len(left) == update.offset:
            left = [*update.prompt_tail, *left]
        shown = update.new[:-1] if update.trim_last and update.new else update.new
        self._ids = [*left, *shown]
        self._start = len(left)
        self._end = len(self._ids)
        self._last = self._end + 1 if update.finished else self._end
        self._offset = update.offset
        self._total = update.offset + len(update.new)
        # Where the output begins: released text never goes back into the prompt.
        self._output_start = max(self._start - update.offset, 0)
        self._decoded: dict[int, str] = {}
        # Stop strings count only in text that tokens past min_new_tokens release.
        armed = self._start - update.offset + rules.min_new_tokens
        self._armed_boundary = min(max(armed, 0), self._end)
        self._armed_chars = len(self._text(self._armed_boundary))

    def result(self) -> WindowText:
        before = self._released(self._start).text
        final = self._released(self._last)
        if final.matched is None:
            return WindowText(final.text[len(before) :])
        # Whether a stop has matched only grows with the text, so search for the first.
        candidates = range(self._armed_boundary, self._last + 1)
        index = bisect.bisect_left(
            candidates, True, key=lambda j: self._released(j).matched is not None
        )
        first = candidates[index]
        released = self._released(first)
        stop_at = self._output_tokens(first)
        if first <= self._start:
            return WindowText("", stop_at, released.matched)
        return WindowText(released.text[len(before) :], stop_at, released.matched)

    def _output_tokens(self, boundary: int) -> int:
        if boundary > self._end:
            return self._total
        return self._offset + boundary - self._start

    def _decoded_at(self, boundary: int) -> str:
        text = self._decoded.get(boundary)
        if text is None:
            ids = self._ids[:boundary]
            text = self._decode(ids, skip_special_tokens=self._skip_special_tokens)
            self._decoded[boundary] = text
        return text

    def _text(self, boundary: int) -> str:
        """Text released at a boundary before stop strings: up to a whole character."""
        if boundary > self._end:
            return self._decoded_at(self._end)
        for j in range(boundary, max(boundary - MAX_PENDING_TOKENS, self._output_start) - 1, -1):
            text = self._decoded_at(j)
            if not text.endswith(REPLACEMENT_CHAR):
                return text
        # A final incomplete sequence decodes as one replacement character; holding back
        # just that one keeps the released text a prefix of all later text.
        return self._decoded_at(boundary)[:-1]

    def _released(self, boundary: int) -> StopResult:
        """Text released at a boundary and the stop string that ended it, if any."""
        text = self._text(boundary)
        if not self._stops:
            return StopResult(text, None)
        armed = self._armed_chars
        found = StopStringMatcher(self._stops, self._no_stop_trim).feed(text[armed:])
        if found.matched is None and boundary > self._end:
            return StopResult(text, None)
        return StopResult(text[:armed] + found.text, found.matched)
