"""Prometheus metrics of cachectl: the host KV tier of each engine it serves and the storage
tier behind them.

Names follow SGLang's `hicache` wording with the `radixmesh:` prefix."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from radixmesh.engine.stores.page_mover import StorageStats

if TYPE_CHECKING:
    from radixmesh.engine.stores.host_pool import HostSegments

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


_BACKEND = ("backend",)
STORAGE_PAGES = Counter(
    "radixmesh:hicache_storage_pages",
    "Storage pages by outcome: hit, miss, corrupt (failed its checksum), read_error, written, "
    "already_stored (a write skipped), write_error, dropped (the write queue was full)",
    (*_BACKEND, "outcome"),
)
STORAGE_BYTES = Counter(
    "radixmesh:hicache_storage_bytes", "Bytes read from and written to storage",
    (*_BACKEND, "direction"),
)
STORAGE_SECONDS = Histogram(
    "radixmesh:hicache_storage_seconds",
    "Latency of one storage call (get, put, exists)",
    (*_BACKEND, "op"),
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
)
STORAGE_QUEUE_BYTES = Gauge(
    "radixmesh:hicache_storage_queue_bytes", "Bytes of pages waiting to be written to storage"
)


class StorageMetrics(StorageStats):
    """The storage tier's counts as Prometheus metrics."""

    def pages(self, backend: str, outcome: str, count: int = 1) -> None:
        if count:
            STORAGE_PAGES.labels(backend, outcome).inc(count)

    def bytes(self, backend: str, direction: str, count: int) -> None:
        STORAGE_BYTES.labels(backend, direction).inc(count)

    def queued(self, nbytes: int) -> None:
        STORAGE_QUEUE_BYTES.set(nbytes)

    def call(self, backend: str, op: str, seconds: float) -> None:
        STORAGE_SECONDS.labels(backend, op).observe(seconds)
