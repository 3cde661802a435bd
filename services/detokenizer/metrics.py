"""Prometheus metrics of the detokenizer service."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

_P = "radixmesh_detokenizer_"

UPDATES = Counter(_P + "updates_total", "Token updates detokenized")
CHUNKS = Counter(_P + "chunks_total", "Text chunks published to tokenizer replicas")
STOP_MATCHES = Counter(_P + "stop_string_matches_total", "Stop strings matched")
ERRORS = Counter(_P + "errors_total", "Token updates that could not be detokenized")
HANDLE_SECONDS = Histogram(
    _P + "handle_seconds",
    "Time to detokenize one TokenStep and publish its chunks",
    buckets=(0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
)
