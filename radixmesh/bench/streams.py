"""Reading streamed answers: SSE lines, token arrival times, and each API's event shape.

No transport here: the backends feed these with lines and clock readings."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


class StreamError(Exception):
    """The server answered with an error, or a stream ended without finishing."""


def sse_payload(line: str) -> dict[str, Any] | None:
    """The JSON object of one `data:` line; None for blank, comment, other and [DONE] lines."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    if not data or data == "[DONE]":
        return None
    payload = json.loads(data)
    if not isinstance(payload, dict):
        raise StreamError(f"a streamed event is not a JSON object: {data[:200]}")
    if "error" in payload:
        raise StreamError(_error_message(payload["error"]))
    return payload


def _error_message(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)


@dataclass
class TokenClock:
    """When a stream's tokens arrived, from (time, tokens so far) readings."""

    started: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    itls: list[float] = field(default_factory=list)

    def observe(self, now: float, tokens_so_far: int) -> None:
        """Record that tokens_so_far tokens had arrived by now."""
        new = tokens_so_far - self.tokens
        if new <= 0:
            return
        if self.first is None:
            self.first = now
            # Tokens that came along with the first one have no gap of their own to report.
        elif self.last is not None:
            self.itls += [(now - self.last) / new] * new
        self.last = now
        self.tokens = tokens_so_far

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.started


@dataclass
class NativeStream:
    """SGLang-native /generate events: cumulative text, output ids and meta_info."""

    clock: TokenClock
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    cached_tokens_details: dict[str, int] | None = None  # the hit per tier, when split
    completion_tokens: int = 0
    finish_reason: Any = None

    def feed(self, event: dict[str, Any], now: float) -> None:
        """Take one streamed event that arrived at `now`."""
        meta = event.get("meta_info") or {}
        self.completion_tokens = int(meta.get("completion_tokens", self.completion_tokens))
        self.prompt_tokens = meta.get("prompt_tokens", self.prompt_tokens)
        self.cached_tokens = meta.get("cached_tokens", self.cached_tokens)
        details = meta.get("cached_tokens_details")
        if details is not None:
            self.cached_tokens_details = {tier: int(n) for tier, n in details.items()}
        self.finish_reason = meta.get("finish_reason") or self.finish_reason
        if event.get("output_ids") is not None:
            self.output_ids = list(event["output_ids"])
        self.clock.observe(now, self.completion_tokens)

    def check_finished(self) -> None:
        """Raise unless the stream ended with a finish reason other than an abort."""
        reason = self.finish_reason
        if reason is None:
            raise StreamError("the stream ended before the request finished")
        if isinstance(reason, dict) and reason.get("type") == "abort":
            raise StreamError(f"the request was aborted: {reason.get('message', reason)}")


@dataclass
class OpenAIStream:
    """/v1/completions events: text deltas, then (when asked for) a usage event."""

    clock: TokenClock
    requested_tokens: int
    text: str = ""
    chunks: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    usage_completion_tokens: int | None = None
    finish_reason: str | None = None

    def feed(self, event: dict[str, Any], now: float) -> None:
        """Take one streamed event that arrived at `now`."""
        for choice in event.get("choices") or []:
            delta = choice.get("text") or ""
            if delta:
                # Without per-event token counts each non-empty event counts as one token.
                self.text += delta
                self.chunks += 1
                self.clock.observe(now, self.chunks)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        usage = event.get("usage")
        if usage:
            self.prompt_tokens = usage.get("prompt_tokens")
            self.usage_completion_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            self.cached_tokens = details.get("cached_tokens")

    @property
    def output_tokens(self) -> int:
        """The usage count; else a length finish means exactly what was asked; else events."""
        if self.usage_completion_tokens is not None:
            return int(self.usage_completion_tokens)
        if self.finish_reason == "length":
            return self.requested_tokens
        return self.chunks

    def check_finished(self) -> None:
        """Raise unless the stream ended with a finish reason."""
        if self.finish_reason is None:
            raise StreamError("the stream ended before the request finished")
