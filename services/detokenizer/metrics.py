"""Prometheus metrics of the detokenizer service.

SGLang's detokenizer exports none, so every name carries `radixmesh:detokenizer_`."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.proto.convert import ints

_P = "radixmesh:detokenizer_"

UPDATES = Counter(_P + "updates_total", "Token updates detokenized")
TOKENS = Counter(_P + "tokens_total", "Output tokens detokenized")
FINISHED = Counter(_P + "finished_requests_total", "Requests whose last update was detokenized")
CHUNKS = Counter(_P + "chunks_total", "Text chunks published to tokenizer replicas")
STOP_MATCHES = Counter(_P + "stop_string_matches_total", "Stop strings matched")
ERRORS = Counter(_P + "errors_total", "Token updates that could not be detokenized")
HANDLE_SECONDS = Histogram(
    _P + "handle_seconds",
    "Time to detokenize one TokenStep and publish its chunks",
    buckets=(0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
)


def observe_step(step: mpb.TokenStep) -> None:
    """Count one TokenStep's updates, their tokens and the requests they finish (packed
    updates finish none)."""
    updates, packed = step.updates, step.packed
    UPDATES.inc(len(updates) + len(packed.rids))
    TOKENS.inc(sum(len(u.new_ids) for u in updates) + len(ints(packed.new_ids)))
    FINISHED.inc(sum(u.HasField("finish") for u in updates))
