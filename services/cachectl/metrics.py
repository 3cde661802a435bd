"""Prometheus metrics of cachectl: the host KV tier of each engine it serves.

Names follow SGLang's `hicache` wording with the `radixmesh:` prefix."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge

from radixmesh.services.cachectl.host_pool import HostSegments

_ENGINE = ("engine_id",)

HOST_SLOTS = Gauge(
    "radixmesh:hicache_host_slots", "Token slots of the engine's host KV segment", _ENGINE
)
HOST_USED_SLOTS = Gauge(
    "radixmesh:hicache_host_used_slots",
    "Host token slots the engine's scheduler holds (as it recorded them)",
    _ENGINE,
)
HOST_BYTES = Gauge("radixmesh:hicache_host_bytes", "Bytes of every host KV segment of cachectl")
HOST_REPEATED_SLOTS = Counter(
    "radixmesh:hicache_host_repeated_slots",
    "Host slots recorded while in use or forgotten while free (a scheduler's slip)",
    (*_ENGINE, "op"),
)


def show(segments: HostSegments, engine_id: str) -> None:
    """The gauges of the engine's segment as it is now: none once it has none."""
    if engine_id in segments.engines():
        stats = segments.stats(engine_id)
        HOST_SLOTS.labels(engine_id).set(stats.num_slots)
        HOST_USED_SLOTS.labels(engine_id).set(stats.used_slots)
    else:
        for gauge in (HOST_SLOTS, HOST_USED_SLOTS):
            with contextlib.suppress(KeyError):  # never shown: its open failed
                gauge.remove(engine_id)
    HOST_BYTES.set(segments.total_bytes)


def repeated(engine_id: str, op: str, count: int) -> None:
    """Slots of a Record ("record") or Forget ("forget") that changed nothing."""
    if count:
        HOST_REPEATED_SLOTS.labels(engine_id, op).inc(count)
