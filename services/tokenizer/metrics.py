"""Prometheus metrics of the tokenizer service: each request as its client sees it.

Names follow SGLang's tokenizer metrics with the `radixmesh:` prefix; metrics SGLang has
no name for carry the service in theirs (`radixmesh:tokenizer_...`)."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from radixmesh.core.finish import FinishKind
from radixmesh.core.meta_info import CachedTokens

if TYPE_CHECKING:  # the client imports this module to count what it sends
    from radixmesh.services.tokenizer.generation import GenerationChunk

Clock = Callable[[], float]

_MODEL = ("model_name",)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.7, 1, 2, 4, 8, 15, 30, 60, 120, 300)
_ITL_BUCKETS = (
    0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2, 5,
)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600, 1200, 2400)

REQUESTS = Counter(
    "radixmesh:tokenizer_api_requests_total",
    "HTTP and gRPC answers, by endpoint and status",
    ["endpoint", "status"],
)
ENGINES = Gauge("radixmesh:tokenizer_engines", "Engines this replica can route to")
IN_FLIGHT = Gauge(
    "radixmesh:tokenizer_num_in_flight_reqs", "Requests sent to engines and not ended", _MODEL
)
PROMPT_TOKENS = Counter(
    "radixmesh:prompt_tokens_total", "Prompt tokens of requests sent to engines", _MODEL
)
GENERATION_TOKENS = Counter(
    "radixmesh:generation_tokens_total", "Output tokens delivered to clients", _MODEL
)
CACHED_TOKENS = Counter(
    "radixmesh:cached_tokens_total",
    "Prompt tokens the engines found in a prefix cache, by the tier their KV came from",
    (*_MODEL, "tier"),
)
_TIERS = ("device", "host", "storage")
NUM_REQUESTS = Counter("radixmesh:num_requests_total", "Requests ended, however", _MODEL)
NUM_ABORTED = Counter(
    "radixmesh:num_aborted_requests_total",
    "Requests ended by an abort: the client hung up, or an engine or the mesh gave up",
    _MODEL,
)
NUM_OVERLOADED = Counter(
    "radixmesh:num_overloaded_requests_total",
    "Requests refused with 503 because max_queued_requests were already waiting",
    _MODEL,
)
TIME_TO_FIRST_TOKEN = Histogram(
    "radixmesh:time_to_first_token_seconds",
    "From sending a request to an engine to its first output token",
    _MODEL,
    buckets=_TTFT_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "radixmesh:inter_token_latency_seconds",
    "Time between output tokens after the first, one observation per token",
    _MODEL,
    buckets=_ITL_BUCKETS,
)
E2E_LATENCY = Histogram(
    "radixmesh:e2e_request_latency_seconds",
    "From sending a request to an engine to its last chunk",
    _MODEL,
    buckets=_E2E_BUCKETS,
)


def observe_each(histogram: Histogram, share: float, count: int) -> None:
    """`count` observations of `share` at once, as `count` calls of `histogram.observe`
    would record them: one bucket found, not one search and two locked increments a token.
    (prometheus_client has no call for it; its buckets are sorted upper bounds, +Inf last.)"""
    histogram._sum.inc(share * count)
    histogram._buckets[bisect_left(histogram._upper_bounds, share)].inc(count)


class TokenizerMetrics:
    """The per-request metrics of one served model."""

    def __init__(self, model_name: str, clock: Clock = time.monotonic) -> None:
        self.model_name = model_name
        self.clock = clock
        labels = {"model_name": model_name}
        self.in_flight = IN_FLIGHT.labels(**labels)
        self.prompt_tokens = PROMPT_TOKENS.labels(**labels)
        self.generation_tokens = GENERATION_TOKENS.labels(**labels)
        self.cached_tokens = {t: CACHED_TOKENS.labels(**labels, tier=t) for t in _TIERS}
        self.num_requests = NUM_REQUESTS.labels(**labels)
        self.num_aborted = NUM_ABORTED.labels(**labels)
        self.num_overloaded = NUM_OVERLOADED.labels(**labels)
        self.ttft = TIME_TO_FIRST_TOKEN.labels(**labels)
        self.itl = INTER_TOKEN_LATENCY.labels(**labels)
        self.e2e = E2E_LATENCY.labels(**labels)

    def overloaded(self) -> None:
        """A request refused for max_queued_requests."""
        self.num_overloaded.inc()

    def request(self, prompt_tokens: int) -> RequestMetrics:
        """Start timing a request that is about to be sent to an engine."""
        return RequestMetrics(self, prompt_tokens)


class RequestMetrics:
    """One request's timeline; every counter is settled when its last chunk arrives."""

    def __init__(self, metrics: TokenizerMetrics, prompt_tokens: int) -> None:
        self._m = metrics
        self._started = metrics.clock()
        self._last_token_at: float | None = None
        self._tokens = 0
        self._last: GenerationChunk | None = None  # its prefix hit, split by tier, at the end
        self._ended = False
        metrics.prompt_tokens.inc(prompt_tokens)
        metrics.in_flight.inc()

    def on_chunk(self, chunk: GenerationChunk) -> None:
        """Record a chunk before it goes to the client (so a finished answer is counted)."""
        if self._ended:
            return
        now = self._m.clock()
        new = chunk.completion_tokens - self._tokens
        if new > 0:
            if self._last_token_at is None:
                self._m.ttft.observe(now - self._started)
            else:
                # Tokens that arrive together shared the wait: each gets an equal part.
                observe_each(self._m.itl, (now - self._last_token_at) / new, new)
            self._last_token_at = now
            self._tokens = chunk.completion_tokens
        self._last = chunk
        if chunk.finish is not None:
            self._m.e2e.observe(now - self._started)
            # A stop string can trim tokens already counted: the last chunk has the total.
            self._end(chunk.completion_tokens, chunk.finish.kind is FinishKind.ABORT)

    def close(self) -> None:
        """The request is over; without a last chunk it was aborted (e.g. a hang-up)."""
        if not self._ended:
            self._end(self._tokens, aborted=True)

    def _end(self, completion_tokens: int, aborted: bool) -> None:
        self._ended = True
        m = self._m
        m.in_flight.dec()
        m.generation_tokens.inc(completion_tokens)
        cached = self._last.cached_tokens_details if self._last else CachedTokens()
        for tier, tokens in cached.to_dict().items():
            m.cached_tokens[tier].inc(tokens)
        m.num_requests.inc()
        if aborted:
            m.num_aborted.inc()
