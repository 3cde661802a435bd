"""Detokenization: the text of an update's new ids, computed from a bounded window of the
ids before them, the same whichever replica computes it and however the request's tokens
were split into updates.

Every update's text is a difference of one function of the request's tokens: the text
released once output token k exists. Before stop strings, that is the decoded text up to
the last token boundary (at most `MAX_PENDING_TOKENS` back) where the text ends in a whole
character, so a token whose bytes end inside a character waits, with the rest of its text,
for the bytes that complete it. From the first token past min_new_tokens on, a suffix that
may begin a stop string is held back too, and the first stop string to complete ends the
text. A finished request releases everything held back.

UTF-8 resynchronizes within a character, so decoding from a few bytes too early gives the
same text after that point as decoding the whole request: a window of
`detok_context_size` ids is enough for any update (`window_text`, the detokenizer
service); one that knows the request's earlier updates needs fewer (`RequestText`, the
in-process engine).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence, Set
from dataclasses import dataclass
from typing import NamedTuple, Protocol

REPLACEMENT_CHAR = "\ufffd"
# Valid text never keeps more than 4 tokens pending (one per byte of a character); a longer
# run of incomplete tails means invalid bytes, which are released once they are settled.
MAX_PENDING_TOKENS = 8


class DecodeFn(Protocol):
    """Decodes token ids to text, e.g. `tokenizers.Tokenizer.decode`."""

    def __call__(
        self, ids: Sequence[int], skip_special_tokens: bool,
        spaces_between_special_tokens: bool = False,
    ) -> str: ...


# Each id's own text where a decode joins them, None where it does not; the whole table None
# for a tokenizer whose decoder does not join (see Tokenizer.pieces).
Pieces = Sequence[str | None] | None


class StopResult(NamedTuple):
    """Text safe to release now, and the stop string that ended the stream, if any."""

    text: str
    matched: str | None


class StopStringMatcher:
    """Where stop strings end a text, and how much of its end may still begin one."""

    def __init__(self, stops: Sequence[str], no_stop_trim: bool = False) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._no_stop_trim = no_stop_trim
        self._prefixes = {stop[:n] for stop in self._stops for n in range(1, len(stop))}
        # The lengths of those prefixes by their last character, longest first: a text's
        # last character rules out most of them at once.
        self._prefix_lens: dict[str, list[int]] = {}
        for prefix in sorted(self._prefixes, key=len, reverse=True):
            self._prefix_lens.setdefault(prefix[-1], []).append(len(prefix))

    def release(self, text: str) -> StopResult:
        """The part of `text` safe to release now, and the stop string that ends it, if any.

        A stop ends the text before it (after it with no_stop_trim). Without one, a suffix
        that may begin a stop is held back: more text may complete it.
        """
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            return StopResult(text[: start + len(stop) if self._no_stop_trim else start], stop)
        return StopResult(text[: len(text) - self._partial_stop_len(text)], None)

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """Returns the earliest stop occurrence; the longest stop wins a tie."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            start = text.find(stop)
            if start < 0:
                continue
            if best is None or (start, -len(stop)) < (best[0], -len(best[1])):
                best = (start, stop)
        return best

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop."""
        for n in self._prefix_lens.get(text[-1:], ()):
            if n <= len(text) and text[-n:] in self._prefixes:
                return n
        return 0


@functools.lru_cache(maxsize=256)
def _stop_matcher(stop: tuple[str, ...], no_stop_trim: bool) -> StopStringMatcher | None:
    """The matcher of a request's stop strings, built once for all its updates."""
    stops = [s for s in stop if s]
    return StopStringMatcher(stops, no_stop_trim) if stops else None


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
    spaces_between_special_tokens: bool = True  # only with skip_special_tokens false

    @functools.cached_property
    def plain(self) -> bool:
        """No stop strings and no spaces set around special tokens: the text of new ids is
        what they add to a decode of the ids before them."""
        return not any(self.stop) and not (
            self.spaces_between_special_tokens and not self.skip_special_tokens)


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


# Ids of context the difference of two decodes starts from (see window_text): a decode
# costs about 0.12 us an id.
_NEAR_CONTEXT = 4


def window_text(decode: DecodeFn, rules: TextRules, update: Update,
                pieces: Pieces = None) -> WindowText:
    """The text the update adds to the request's output, stop strings applied. `pieces`:
    each id's own text where a decode joins them (`Tokenizer.pieces`), which spares the
    decodes of most updates."""
    if rules.plain:
        # Most updates: no stop strings, and the text ends in a whole character before the
        # new ids and after them, so what they add is the difference of two decodes.
        # The last few ids of the context do: where their text ends in a whole character,
        # the whole context's does too (a character's bytes never begin with a
        # continuation byte), and whatever they decode to before that is the same in both
        # decodes. Text that ends inside a character, or no text (skipped special tokens,
        # whose neighbours a decoder may treat as the start), takes the long way.
        context = update.context
        if len(context) == update.offset:
            context = [*update.prompt_tail, *context]
        new = update.new[:-1] if update.trim_last and update.new else update.new
        if pieces is not None and context:
            text = joined_pieces(pieces, new, after=context[-1])
            if text is not None:
                return WindowText(text)
        near = context[-_NEAR_CONTEXT:]
        before = decode(near, skip_special_tokens=rules.skip_special_tokens)
        after = decode([*near, *new], skip_special_tokens=rules.skip_special_tokens)
        if before and not before.endswith(REPLACEMENT_CHAR) and not after.endswith(
                REPLACEMENT_CHAR):
            return WindowText(after[len(before) :])
    window = _Window(decode, rules, update.context, update.offset, update.prompt_tail, pieces)
    return window.update(update.new, update.finished, update.trim_last)


def joined_pieces(pieces: Sequence[str | None], ids: Sequence[int], after: int | None = None
                  ) -> str | None:
    """The text of `ids`, after the id `after` when given, from the ids' own texts
    (`Tokenizer.pieces`) where every one is whole characters (None where one is not): the
    text after such an id ends in a whole character, and whole characters follow it
    unchanged, so a decode joins them. Stop strings are not applied."""
    try:
        if after is not None and pieces[after] is None:
            return None
        texts = [pieces[i] for i in ids]
    except IndexError:  # an id past the tokenizer's vocabulary
        return None
    return None if None in texts else "".join(texts)  # type: ignore[arg-type]


# Ids a window of RequestText takes on beyond the context it started with before a new one
# starts: each update decodes one window a few ids longer rather than two lists, and a new
# window costs a second decode and the check of what the last one left unsettled.
_SLACK = 8


class RequestText:
    """One request's text, update by update, where all its ids are at hand (the in-process
    engine): for each update, what `window_text` gives for it.

    A replica that sees one update alone takes detok_context_size ids, enough for any
    update, and decodes them twice: up to the new ids and after them. Knowing the request,
    a window can start later: before the ids still pending after the last update and the
    bytes held back as the start of a stop string, it needs only _RESYNC_BYTES to be in
    step with the whole text, counted in ids that carry bytes. And one window serves the
    updates after it until it has grown by _SLACK ids, what it decoded for one update
    serving the next: most updates decode one list of 5 to 16 ids, most of their cost.

    A window that suffices for one update suffices for the later ones: the text before the
    last boundary where it ended in a whole character never changes, and no stop string
    can begin there unless its start is held back already.
    """

    def __init__(
        self, decode: DecodeFn, rules: TextRules, prompt: Sequence[int], specials: Set[int],
        pieces: Pieces = None,
    ) -> None:
        self._decode = decode
        self._rules = rules
        self._pieces = pieces  # see window_text
        self._ids = list(prompt)
        self._prompt_len = len(self._ids)
        # Skipped special tokens decode to nothing, so they carry no byte of context.
        self._skipped = specials if rules.skip_special_tokens else frozenset()
        self._window: _Window | None = None
        self._renew_at = 0
        self._finished = False
        self._stopped: WindowText | None = None

    def update(self, new: Sequence[int], finished: bool, trim_last: bool = False) -> WindowText:
        """The text `new` adds: `window_text` of the update with these fields."""
        # The finish is a boundary past the window's last id: a window cannot go on after it.
        if self._finished:
            raise RuntimeError("an update after the request finished")
        self._finished = finished
        self._ids.extend(new)
        if self._stopped is not None:  # a later window need not hold the stop string
            return WindowText("", self._stopped.stop_at, self._stopped.matched)
        window = self._window
        if window is None or window.context_size >= self._renew_at:
            window = self._window = self._new_window(window, len(self._ids) - len(new))
        result = window.update(new, finished, trim_last)
        if result.matched is not None:
            self._stopped = result
        return result

    def _new_window(self, last: _Window | None, start: int) -> _Window:
        """A window of the ids before `start` that the update from there needs, by what
        `last` left unsettled."""
        offset = start - self._prompt_len
        # Nothing of the prompt is pending: released text starts where the output does.
        pending, held = last.unsettled() if last else (0, 0)
        # A stop string can only begin in text not released yet.
        reach = held + _RESYNC_BYTES
        size = self._context_size(start, pending, reach)
        # Where stop strings start counting is found by walking back from that boundary
        # too: a window that holds the boundary must hold that walk.
        armed = self._rules.min_new_tokens
        if offset - size < armed < offset:
            size = self._context_size(start, offset - armed + MAX_PENDING_TOKENS, reach)
        self._renew_at = size + _SLACK
        return _Window(self._decode, self._rules, self._ids[start - size : start], offset,
                       pieces=self._pieces)

    def _context_size(self, start: int, pending: int, reach: int) -> int:
        """Ids before `start`: the last `pending` and, before them, `reach` carrying bytes."""
        ids, skipped = self._ids, self._skipped
        first = max(start - pending, 0)
        if skipped.isdisjoint(ids[max(first - reach, 0) : first]):
            return min(pending + reach, start)
        while first > 0 and reach > 0:
            first -= 1
            reach -= ids[first] not in skipped
        return start - first


class _Window:
    """A window of a request's ids and the text released at each of its token boundaries;
    each update appends its new ids, and what was decoded for one update serves the next."""

    # Boundary j follows the window's first j ids; end + 1 stands for the finish, so a
    # finished window takes no further update.

    def __init__(
        self,
        decode: DecodeFn,
        rules: TextRules,
        context: Sequence[int],
        offset: int,
        prompt_tail: Sequence[int] = (),
        pieces: Pieces = None,
    ) -> None:
        self._decode = decode
        self._pieces = pieces
        self._skip_special_tokens = rules.skip_special_tokens
        # Asked of the decode function only where it changes the text, so one that cannot
        # space special tokens serves every other request.
        spaced = rules.spaces_between_special_tokens and not rules.skip_special_tokens
        self._spacing = {"spaces_between_special_tokens": True} if spaced else {}
        self._stops = _stop_matcher(rules.stop, rules.no_stop_trim)
        # A context of exactly the output so far reaches the prompt, whose tail precedes it.
        if len(context) == offset:
            context = [*prompt_tail, *context]
        self._ids = list(context)
        self._end = len(self._ids)
        self._offset = offset  # output tokens before boundary `_end`
        # Where the output begins: released text never goes back into the prompt.
        self._output_start = max(self._end - offset, 0)
        # Stop strings count only in text that tokens past min_new_tokens release.
        self._armed = self._end - offset + rules.min_new_tokens
        self._armed_boundary = 0
        self._armed_chars = 0
        self._decoded: dict[int, str] = {}
        self._released_at: dict[int, StopResult] = {}

    @property
    def context_size(self) -> int:
        """Ids before the next update's new ids."""
        return self._end

    def update(self, new: Sequence[int], finished: bool, trim_last: bool) -> WindowText:
        """Appends an update's new ids; the text they add, stop strings applied."""
        start, offset = self._end, self._offset
        self._ids.extend(new[:-1] if trim_last and new else new)
        self._end = len(self._ids)
        self._offset = offset + len(new)
        last = self._end + 1 if finished else self._end
        if self._stops is None:  # the text released is the text
            return WindowText(self._text(last)[len(self._text(start)) :])
        # The boundary where stop strings start counting stays at the window's end until
        # min_new_tokens is reached.
        if self._armed_boundary < self._armed:
            self._armed_boundary = min(self._armed, self._end)
            self._armed_chars = len(self._text(self._armed_boundary))
        before = self._released(start).text
        final = self._released(last)
        if final.matched is None:
            return WindowText(final.text[len(before) :])
        # Whether a stop has matched only grows with the text, so search for the first.
        candidates = range(self._armed_boundary, last + 1)
        index = bisect.bisect_left(
            candidates, True, key=lambda j: self._released(j).matched is not None
        )
        first = candidates[index]
        released = self._released(first)
        stop_at = self._offset if first > self._end else offset + first - start
        if first <= start:
            return WindowText("", stop_at, released.matched)
        return WindowText(released.text[len(before) :], stop_at, released.matched)

    def unsettled(self) -> tuple[int, int]:
        """What later ids may still change: how many ids at the window's end have text
        that may, and the bytes of text before them held back as a stop string's start."""
        whole = self._whole(self._end)
        pending = MAX_PENDING_TOKENS if whole is None else self._end - whole
        if self._stops is None:
            return pending, 0
        held = self._text(self._end)[len(self._released(self._end).text) :]
        return pending, len(held.encode())

    def _decoded_at(self, boundary: int) -> str:
        text = self._decoded.get(boundary)
        if text is None:
            ids = self._ids[:boundary]
            text = joined_pieces(self._pieces, ids) if self._pieces is not None else None
            if text is None:
                text = self._decode(ids, skip_special_tokens=self._skip_special_tokens,
                                    **self._spacing)
            self._decoded[boundary] = text
        return text

    def _whole(self, boundary: int) -> int | None:
        """The last boundary, at most MAX_PENDING_TOKENS back, whose text ends in a whole
        character; the output's start counts as one (the prompt's text is context as it
        decodes, even when it ends in U+FFFD)."""
        for j in range(boundary, max(boundary - MAX_PENDING_TOKENS, self._output_start) - 1, -1):
            if j <= self._output_start or not self._decoded_at(j).endswith(REPLACEMENT_CHAR):
                return j
        return None

    def _text(self, boundary: int) -> str:
        """Text released at a boundary before stop strings: up to a whole character."""
        if boundary > self._end:
            return self._decoded_at(self._end)
        text = self._decoded_at(boundary)
        if boundary <= self._output_start or not text.endswith(REPLACEMENT_CHAR):
            return text
        whole = self._whole(boundary)
        if whole is None:
            # A final incomplete sequence decodes as one replacement character; holding back
            # just that one keeps the released text a prefix of all later text.
            return text[:-1]
        return self._decoded_at(whole)

    def _released(self, boundary: int) -> StopResult:
        """Text released at a boundary and the stop string that ended it, if any."""
        released = self._released_at.get(boundary)
        if released is None:
            released = self._released_at[boundary] = self._release(boundary)
        return released

    def _release(self, boundary: int) -> StopResult:
        text = self._text(boundary)
        if self._stops is None:
            return StopResult(text, None)
        # Text up to the armed boundary is released whole, so this holds whatever later
        # updates move that boundary to.
        armed = self._armed_chars
        found = self._stops.release(text[armed:])
        if found.matched is None and boundary > self._end:
            return StopResult(text, None)
        return StopResult(text[:armed] + found.text, found.matched) if armed else found
