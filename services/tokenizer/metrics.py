"""Prometheus metrics of the tokenizer service."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_P = "radixmesh_tokenizer_"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

REQUESTS = Counter(
    _P + "requests_total", "Requests answered, by endpoint and status", ["endpoint", "status"]
)
PROMPT_TOKENS = Counter(_P + "prompt_tokens_total", "Prompt tokens of requests sent to engines")
GENERATION_TOKENS = Counter(_P + "generation_tokens_total", "Output tokens received")
TIME_TO_FIRST_TOKEN = Histogram(
    _P + "time_to_first_token_seconds",
    "From sending a request to an engine to its first output",
    buckets=_LATENCY_BUCKETS,
)
E2E_LATENCY = Histogram(
    _P + "e2e_request_latency_seconds",
    "From sending a request to an engine to its last output",
    buckets=_LATENCY_BUCKETS,
)
IN_FLIGHT = Gauge(_P + "requests_in_flight", "Requests sent to engines and not finished")
ENGINES = Gauge(_P + "engines", "Engines this replica can route to")
