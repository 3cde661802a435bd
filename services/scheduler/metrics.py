"""Prometheus metrics of the scheduler service: one engine's queue, KV pool and cache.

Gauges take SGLang's scheduler names with the `radixmesh:` prefix. The engine's own count
of tokens and requests carries `scheduler_` in its names, so one Prometheus can scrape the
tokenizers (what clients got) and the schedulers (what engines did) without a clash."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from radixmesh.engine.host_tier import HostStats
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler import ScheduledBatch, Scheduler
from radixmesh.engine.speculation import SpeculationStats
from radixmesh.engine.storage_tier import PrefetchOutcome

Clock = Callable[[], float]

DEVICE_TIER, HOST_TIER, STORAGE_TIER = "device", "host", "storage"

_ENGINE = ("model_name", "engine_id")
_TIERED = (*_ENGINE, "tier")
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_SECONDS_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)

NUM_RUNNING = Gauge("radixmesh:num_running_reqs", "Requests prefilling or decoding", _ENGINE)
NUM_QUEUE = Gauge("radixmesh:num_queue_reqs", "Requests waiting to be scheduled", _ENGINE)
NUM_USED_TOKENS = Gauge(
    "radixmesh:num_used_tokens", "KV slots held by requests or the prefix cache", _ENGINE
)
MAX_TOTAL_TOKENS = Gauge("radixmesh:max_total_num_tokens", "KV slots in the pool", _ENGINE)
TOKEN_USAGE = Gauge("radixmesh:token_usage", "Fraction of the KV slots in use", _ENGINE)
CACHE_HIT_RATE = Gauge(
    "radixmesh:cache_hit_rate",
    "Prompt tokens found in the prefix cache over prompt tokens, since start",
    _ENGINE,
)
GEN_THROUGHPUT = Gauge(
    "radixmesh:gen_throughput", "Output tokens per second since the previous status", _ENGINE
)
FORCED_TOKENS = Counter(
    "radixmesh:jump_forward_tokens_total",
    "Output tokens a grammar forced and jump-forward appended without sampling",
    _ENGINE,
)
# Disaggregation: a prompt's KV, by direction (sent by a prefill engine, received by a
# decode engine).
_TRANSFER = (*_ENGINE, "direction")
KV_TRANSFERS = Counter(
    "radixmesh:kv_transfers_total",
    "Prompts whose KV went between a prefill and a decode engine",
    _TRANSFER,
)
KV_TRANSFER_FAILURES = Counter(
    "radixmesh:kv_transfer_failures_total",
    "Prompt KV transfers that failed (the decode engine prefilled the prompt itself)",
    _TRANSFER,
)
KV_TRANSFER_TOKENS = Counter(
    "radixmesh:kv_transfer_tokens_total", "Prompt tokens whose KV was transferred", _TRANSFER
)
KV_TRANSFER_BYTES = Counter(
    "radixmesh:kv_transfer_bytes_total", "Bytes of prompt KV transferred", _TRANSFER
)
KV_TRANSFER_SECONDS = Histogram(
    "radixmesh:kv_transfer_seconds",
    "Time from a transfer's start to its last byte written",
    _TRANSFER,
    buckets=_SECONDS_BUCKETS,
)
KV_TRANSFER_FALLBACKS = Counter(
    "radixmesh:kv_transfer_fallbacks_total",
    "Requests a decode engine prefilled itself after waiting for their KV (a failed, late "
    "or lost transfer)",
    _ENGINE,
)
SPEC_VERIFY_STEPS = Counter(
    "radixmesh:spec_verify_steps_total",
    "Speculative decoding: request steps that verified a draft",
    _ENGINE,
)
SPEC_ACCEPTED_TOKENS = Counter(
    "radixmesh:spec_accepted_tokens_total",
    "Speculative decoding: draft tokens the model accepted",
    _ENGINE,
)
SPEC_ACCEPT_LENGTH = Gauge(
    "radixmesh:spec_accept_length",
    "Speculative decoding: tokens a verify step produced on average (accepted drafts plus "
    "its own), since start",
    _ENGINE,
)
NUM_RETRACTED = Counter(
    "radixmesh:num_retracted_requests_total",
    "Running requests sent back to the queue for lack of KV slots",
    _ENGINE,
)
# Priority scheduling: the request's priority value as a label, the first
# MAX_PRIORITY_LABELS distinct values an engine sees; later ones share OTHER_PRIORITY.
MAX_PRIORITY_LABELS = 16
OTHER_PRIORITY = "other"
_PRIORITY = (*_ENGINE, "priority")
PREEMPTIONS = Counter(
    "radixmesh:num_preempted_requests_total",
    "Running requests preempted for a more important arrival (priority scheduling), by the "
    "preempted request's priority",
    _PRIORITY,
)
QUEUE_SECONDS = Histogram(
    "radixmesh:queue_time_seconds",
    "Time from a request's arrival at the engine to its first admission, by priority",
    _PRIORITY,
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120),
)
LORA_REQUESTS = Counter(
    "radixmesh:lora_requests_total",
    "Requests that arrived for a LoRA adapter, by adapter (the first MAX_PRIORITY_LABELS "
    "names an engine sees; later ones share 'other')",
    (*_ENGINE, "adapter"),
)
CACHE_TOKENS = Gauge(
    "radixmesh:scheduler_cache_tokens", "Tokens held in the prefix cache, by tier", _TIERED
)
PROMPT_TOKENS = Counter(
    "radixmesh:scheduler_prompt_tokens_total", "Prompt tokens of admitted requests", _ENGINE
)
CACHED_TOKENS = Counter(
    "radixmesh:scheduler_cached_tokens_total",
    "Prompt tokens found in the prefix cache when a request was first scheduled, by tier",
    _TIERED,
)
GENERATION_TOKENS = Counter(
    "radixmesh:scheduler_generation_tokens_total", "Output tokens produced", _ENGINE
)
FINISHED = Counter(
    "radixmesh:scheduler_finished_requests_total",
    "Finished requests, by finish reason",
    (*_ENGINE, "finish_reason"),
)
REFUSED = Counter(
    "radixmesh:scheduler_refused_requests_total", "Requests refused at admission", _ENGINE
)
BATCH_TOKENS = Histogram(
    "radixmesh:scheduler_batch_tokens",
    "Tokens computed per model step",
    _ENGINE,
    buckets=_SIZE_BUCKETS,
)
BATCH_REQS = Histogram(
    "radixmesh:scheduler_batch_reqs",
    "Requests per model step",
    _ENGINE,
    buckets=_SIZE_BUCKETS,
)
HOST_COPIES = Counter(
    "radixmesh:hicache_copies_total",
    "Copies between the device KV pool and the host tier, by direction",
    (*_ENGINE, "direction"),
)
HOST_COPY_BYTES = Counter(
    "radixmesh:hicache_copy_bytes_total",
    "KV bytes copied between the device pool and the host tier, by direction",
    (*_ENGINE, "direction"),
)
HOST_PENDING = Gauge(
    "radixmesh:hicache_pending_backups", "Device-to-host copies not yet done", _ENGINE
)
HOST_SKIPPED = Counter(
    "radixmesh:hicache_backups_skipped_total",
    "Backups the write policy wanted but the host tier had no room for",
    _ENGINE,
)
HOST_UP = Gauge(
    "radixmesh:hicache_host_tier_up", "1 while the host tier is attached, else 0", _ENGINE
)
STORAGE_PAGES_STORED = Counter(
    "radixmesh:hicache_storage_pages_stored_total",
    "Host pages handed to cachectl to write to the storage tier",
    _ENGINE,
)
STORAGE_QUERIES = Counter(
    "radixmesh:hicache_storage_queries_total",
    "Requests whose uncached prompt was long enough to ask storage for it",
    _ENGINE,
)
PREFETCHES = Counter(
    "radixmesh:hicache_prefetches_total",
    "Prefetches from storage, by policy and outcome when the request stopped waiting: "
    "complete (every page asked for), partial, or none (no page had arrived)",
    (*_ENGINE, "policy", "outcome"),
)
PREFETCH_TOKENS = Counter(
    "radixmesh:hicache_prefetch_tokens_total",
    "Prompt tokens fetched from storage into the host tier for the requests that wanted them",
    _ENGINE,
)
PREFETCH_WAIT = Histogram(
    "radixmesh:hicache_prefetch_wait_seconds",
    "Time a request waited for its pages from storage, by policy",
    (*_ENGINE, "policy"),
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
HOST_LOST = Counter(
    "radixmesh:hicache_host_tier_lost_total",
    "Times the host tier's owner (cachectl) was lost and the engine went on without it",
    _ENGINE,
)
FORWARD_SECONDS = Histogram(
    "radixmesh:scheduler_forward_seconds",
    "Worker round trip per step",
    _ENGINE,
    buckets=_SECONDS_BUCKETS,
)


class ThroughputMeter:
    """Tokens per second between two readings."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._since = clock()
        self._tokens = 0

    def add(self, tokens: int) -> None:
        self._tokens += tokens

    def read(self) -> float:
        """The rate since the previous reading (or start); starts a new interval."""
        now = self._clock()
        elapsed, tokens = now - self._since, self._tokens
        self._since, self._tokens = now, 0
        return tokens / elapsed if elapsed > 0 else 0.0


class PriorityLabels:
    """A label value chosen by clients (a priority, a LoRA adapter's name): the value itself
    for the first `limit` distinct values, then OTHER_PRIORITY, so that clients choosing
    freely cannot grow the series without bound."""

    def __init__(self, limit: int = MAX_PRIORITY_LABELS) -> None:
        self._limit = limit
        self._seen: set[int | str] = set()

    def __call__(self, value: int | str) -> str:
        if value not in self._seen and len(self._seen) < self._limit:
            self._seen.add(value)
        return str(value) if value in self._seen else OTHER_PRIORITY


class SchedulerMetrics:
    """One engine's metrics; the model's name joins the labels once it is known."""

    def __init__(self, engine_id: str, clock: Clock = time.monotonic) -> None:
        self._labels = {"model_name": "", "engine_id": engine_id}
        self._throughput = ThroughputMeter(clock)
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._retractions = 0
        self._forced = 0
        self._spec = SpeculationStats()  # the figures as last counted
        self._host_copied = HostStats()
        self._host_lost = 0
        self._storage_counted = (0, 0)  # pages stored, queries: counted so far
        self._new_tokens = 0  # generated since the last state(): counted there, once a step
        self.token_bytes = 0  # of one token's KV: what a host copy moves per token
        self._priority = PriorityLabels()
        self._adapter = PriorityLabels()
        self._preempted: dict[int, int] = {}  # preemptions counted so far, by priority
        # Requests not admitted yet: when each arrived, and its priority.
        self._queued: dict[str, tuple[float, int]] = {}
        self._clock = clock
        # Each metric's child for this engine (and the extra labels): looked up once, not
        # at every step (a labels() call costs about 3 us).
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, **extra: str) -> Any:
        """`metric` labelled for this engine and `extra`."""
        key = (metric, *extra.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self._labels, **extra)
        return child

    def start(self, model_name: str, num_slots: int) -> None:
        """Bind the model's name and show the pool's size."""
        self._labels["model_name"] = model_name
        self._children.clear()
        self._child(MAX_TOTAL_TOKENS).set(num_slots)

    def refused(self) -> None:
        """A request the scheduler could not take."""
        self._child(REFUSED).inc()

    def queued(self, req: Req) -> None:
        """A request arrived and waits for its first admission."""
        self._queued[req.rid] = (self._clock(), req.priority)
        if req.lora:
            self._child(LORA_REQUESTS, adapter=self._adapter(req.lora)).inc()

    def admitted(self, batch: ScheduledBatch) -> None:
        """A step was scheduled: the time in the queue of each request it admits first."""
        for new in batch.batch.new_requests:
            queued = self._queued.pop(new.rid, None)  # a readmission was counted before
            if queued is not None:
                since, priority = queued
                self._child(QUEUE_SECONDS, priority=self._priority(priority)).observe(
                    self._clock() - since
                )

    def ended(self, rid: str) -> None:
        """A request finished or was refused: if it never ran, its wait is not counted."""
        self._queued.pop(rid, None)

    def update(
        self,
        first: bool,
        prompt_tokens: int,
        cached_tokens: int,
        new_tokens: int,
        finish_reason: str | None,
        host_tokens: int = 0,
        storage_tokens: int = 0,
    ) -> None:
        """One update of an admitted request on its way to the detokenizers; its first
        counts the prompt and its prefix hit (`host_tokens` of it from the host tier,
        `storage_tokens` from storage)."""
        if first:
            self._prompt_tokens += prompt_tokens
            self._child(PROMPT_TOKENS).inc(prompt_tokens)
            self._cached_tokens += cached_tokens
            device = cached_tokens - host_tokens - storage_tokens
            self._child(CACHED_TOKENS, tier=DEVICE_TIER).inc(device)
            self._child(CACHED_TOKENS, tier=HOST_TIER).inc(host_tokens)
            self._child(CACHED_TOKENS, tier=STORAGE_TIER).inc(storage_tokens)
            self._set_hit_rate()
        self._throughput.add(new_tokens)
        self._new_tokens += new_tokens
        if finish_reason is not None:
            self._child(FINISHED, finish_reason=finish_reason).inc()

    def transfer_sent(self, tokens: int, nbytes: int, ms: float, failed: bool) -> None:
        """A prefill engine handed a request back to its decode engine."""
        self._transfer("sent", tokens, nbytes, ms, failed)

    def transfer_received(self, tokens: int, nbytes: int, ms: float, failed: bool) -> None:
        """A decode engine heard how a request's KV transfer went."""
        self._transfer("received", tokens, nbytes, ms, failed)

    def _transfer(self, direction: str, tokens: int, nbytes: int, ms: float,
                  failed: bool) -> None:
        if failed:
            self._child(KV_TRANSFER_FAILURES, direction=direction).inc()
            return
        self._child(KV_TRANSFERS, direction=direction).inc()
        self._child(KV_TRANSFER_TOKENS, direction=direction).inc(tokens)
        self._child(KV_TRANSFER_BYTES, direction=direction).inc(nbytes)
        self._child(KV_TRANSFER_SECONDS, direction=direction).observe(ms / 1e3)

    def transfer_fallback(self) -> None:
        """A decode engine gave up on a request's KV and prefills it itself."""
        self._child(KV_TRANSFER_FALLBACKS).inc()

    def batch(self, tokens: int, reqs: int) -> None:
        """One step's size; steps that only release requests compute nothing and are skipped."""
        if reqs:
            self._child(BATCH_TOKENS).observe(tokens)
            self._child(BATCH_REQS).observe(reqs)

    def forward_timer(self) -> AbstractContextManager[Any]:
        """Times one step's round trip to the workers."""
        return self._child(FORWARD_SECONDS).time()

    def state(self, sched: Scheduler) -> None:
        """The queue, the KV pool and the cache as they are now, and the tokens generated
        since the last call."""
        if self._new_tokens:
            self._child(GENERATION_TOKENS).inc(self._new_tokens)
            self._new_tokens = 0
        used = sched.config.num_slots - sched.allocator.available()
        self._child(NUM_RUNNING).set(sched.num_running())
        self._child(NUM_QUEUE).set(len(sched.waiting))
        self._child(NUM_USED_TOKENS).set(used)
        self._child(TOKEN_USAGE).set(used / sched.config.num_slots)
        self._child(CACHE_TOKENS, tier=DEVICE_TIER).set(sched.cache.total_size())
        self._child(NUM_RETRACTED).inc(sched.num_retractions - self._retractions)
        self._retractions = sched.num_retractions
        self._child(FORCED_TOKENS).inc(sched.constraints.forced_tokens - self._forced)
        self._forced = sched.constraints.forced_tokens
        spec = sched.speculation.stats
        self._child(SPEC_VERIFY_STEPS).inc(spec.verify_steps - self._spec.verify_steps)
        self._child(SPEC_ACCEPTED_TOKENS).inc(spec.accepted_tokens - self._spec.accepted_tokens)
        self._child(SPEC_ACCEPT_LENGTH).set(spec.mean_accept_length)
        self._spec = dataclasses.replace(spec)
        for priority, n in sched.priority.preemptions.items():
            label = self._priority(priority)
            self._child(PREEMPTIONS, priority=label).inc(n - self._preempted.get(priority, 0))
            self._preempted[priority] = n
        self._host_state(sched)

    def host_tier(self, up: bool, lost: int) -> None:
        """Whether the host tier is attached, and how many times it was lost so far."""
        self._child(HOST_UP).set(1 if up else 0)
        self._child(HOST_LOST).inc(lost - self._host_lost)
        self._host_lost = lost

    def _host_state(self, sched: Scheduler) -> None:
        host = sched.tiers.host
        self._child(CACHE_TOKENS, tier=HOST_TIER).set(sched.cache.host_size())
        self._child(HOST_PENDING).set(sched.cache.pending_backups())
        if host is None:
            self._host_copied = HostStats()  # a new tier counts from zero
            return
        now, before = host.stats, self._host_copied
        for direction, copies, tokens in (
            ("to_host", now.backups - before.backups, now.backup_tokens - before.backup_tokens),
            ("to_device", now.loads - before.loads, now.load_tokens - before.load_tokens),
        ):
            self._child(HOST_COPIES, direction=direction).inc(copies)
            self._child(HOST_COPY_BYTES, direction=direction).inc(tokens * self.token_bytes)
        self._child(HOST_SKIPPED).inc(now.backups_skipped - before.backups_skipped)
        self._host_copied = dataclasses.replace(now)
        storage = sched.tiers.storage
        if storage is None:
            self._storage_counted = (0, 0)
            return
        stored, queries = storage.stats.pages_stored, storage.stats.queries
        self._child(STORAGE_PAGES_STORED).inc(stored - self._storage_counted[0])
        self._child(STORAGE_QUERIES).inc(queries - self._storage_counted[1])
        self._storage_counted = (stored, queries)

    def prefetched(self, outcome: PrefetchOutcome) -> None:
        """A request stopped waiting for its pages from storage."""
        kind = ("none" if not outcome.pages_arrived else
                "complete" if outcome.pages_arrived == outcome.pages_asked else "partial")
        self._child(PREFETCHES, policy=outcome.policy, outcome=kind).inc()
        self._child(PREFETCH_TOKENS).inc(outcome.tokens)
        self._child(PREFETCH_WAIT, policy=outcome.policy).observe(outcome.waited_s)

    def throughput(self) -> None:
        """Show the output rate since the previous call (the status heartbeat)."""
        self._child(GEN_THROUGHPUT).set(self._throughput.read())

    def _set_hit_rate(self) -> None:
        if self._prompt_tokens:
            rate = self._cached_tokens / self._prompt_tokens
            self._child(CACHE_HIT_RATE).set(rate)
