"""What one request measured, and the figures of a whole run computed from them."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """One request (one turn of a conversation) as the client saw it; times in seconds."""

    conversation: int
    turn: int  # 1-based
    sent_tokens: int  # prompt tokens the client sent
    requested_tokens: int  # output tokens asked for
    error: str | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None  # as the server counted them, when it says
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache
    # cached_tokens per tier ({"device": .., "host": .., "storage": ..}), when the server
    # splits it (radixmesh's and SGLang's meta_info.cached_tokens_details)
    cached_tokens_details: dict[str, int] | None = None
    ttft: float | None = None
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)  # one gap per token after the first

    @property
    def ok(self) -> bool:
        return self.error is None


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile, interpolating linearly between the closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Sequence[float], scale: float = 1000.0) -> dict[str, float] | None:
    """Mean and percentiles of values (seconds, reported in ms by default); None if empty."""
    if not values:
        return None
    out = {"mean": statistics.fmean(values) * scale}
    out |= {f"p{p}": percentile(values, p) * scale for p in PERCENTILES}
    return out


def cache_hit_rate(results: Sequence[RequestResult]) -> float | None:
    """Sum of cached prompt tokens over sum of prompt tokens, where the server reports both."""
    reported = [r for r in results if r.ok and r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens if r.prompt_tokens is not None else r.sent_tokens
                 for r in reported)
    if not reported or not prompt:
        return None
    return sum(r.cached_tokens or 0 for r in reported) / prompt


def _tpot(r: RequestResult) -> float | None:
    """Time per output token after the first."""
    if r.ttft is None or r.output_tokens < 2:
        return None
    return (r.latency - r.ttft) / (r.output_tokens - 1)


def summarize(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    """Throughput, latency distributions, cache hit rate and per-turn TTFT of one run."""
    done = [r for r in results if r.ok]
    input_tokens = sum(r.sent_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    per_s = 1 / duration if duration > 0 else 0.0
    tpots = [t for t in map(_tpot, done) if t is not None]
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error is not None}),
        "duration_s": duration,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "expected_output_tokens": sum(r.requested_tokens for r in done),
        "exact_output_lengths": all(r.output_tokens == r.requested_tokens for r in done),
        "request_throughput": len(done) * per_s,
        "input_throughput": input_tokens * per_s,
        "output_throughput": output_tokens * per_s,
        "total_throughput": (input_tokens + output_tokens) * per_s,
        "ttft_ms": distribution([r.ttft for r in done if r.ttft is not None]),
        "itl_ms": distribution([gap for r in done for gap in r.itls]),
        "tpot_ms": distribution(tpots),
        "e2e_latency_ms": distribution([r.latency for r in done]),
        "cache_hit_rate": cache_hit_rate(done),
    }
    turns = sorted({r.turn for r in results})
    if len(turns) > 1:
        summary["ttft_by_turn_ms"] = {
            str(t): distribution([r.ttft for r in done if r.turn == t and r.ttft is not None])
            for t in turns
        }
        summary["cache_hit_rate_by_turn"] = {
            str(t): cache_hit_rate([r for r in done if r.turn == t]) for t in turns
        }
    return summary
