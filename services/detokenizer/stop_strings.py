"""Stop-string matching over a stream of text deltas."""

from collections.abc import Sequence
from typing import NamedTuple


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
