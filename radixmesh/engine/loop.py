"""The engine loop, the one place a replica's steps are driven: take what arrived, schedule
a step, run it on the model runner, fold the result back, publish what changed.

It serves both the in-process Engine and the scheduler service; only the executor (a
direct call on the torch thread, or gRPC to every worker rank) and the sink (in-process
streams, or NATS) differ. With overlap on, step N+1 is scheduled and submitted while
step N runs, and N's result is processed after; off, each step completes before the next
is scheduled (simpler to debug, slower)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.step import StepResult
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler import ScheduledBatch, Scheduler

T = TypeVar("T")


class Executor(Protocol):
    """Runs steps on the model runner(s), one after another in the order submitted."""

    def submit(self, batch: ScheduledBatch) -> Awaitable[StepResult]:
        """Start the step now (behind any step still running); await its result."""
        ...


class Sink(Protocol):
    """Where requests' progress goes."""

    def refuse(self, req: Req, error: Exception) -> None:
        """A request that will never run (refused, or the loop stopped first); report it
        with the next publish."""

    async def publish(self, updated: list[Req]) -> None:
        """Requests that gained tokens or finished, and every refusal since the last call."""


# Called with each scheduled batch and when schedule() started and ended (time.time_ns).
ScheduleHook = Callable[[ScheduledBatch, int, int], None]


class ExecutorLost(Exception):
    """The executor's model runners are gone (a worker died): what they held is lost."""


# Called once every request has ended after an ExecutorLost; returns when the model
# runners are back (fresh: no request, no cached KV).
LostHook = Callable[[ExecutorLost], Awaitable[None]]


class EngineLoop:
    """`run()` drives it on an event loop; add, abort, flush and info may be called from
    any thread and take effect between steps, in the order they were called."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        sink: Sink,
        overlap: bool = True,
        on_schedule: ScheduleHook | None = None,
        on_lost: LostHook | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.sink = sink
        self.overlap = overlap
        self._on_schedule = on_schedule
        self._on_lost = on_lost
        self._inbox: deque[tuple[str, Any]] = deque()
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    # ---- what arrives ---------------------------------------------------------------

    def add(self, req: Req) -> None:
        """Queue a request; a refusal goes to the sink."""
        self._post("add", req)

    def abort(self, rid: str, reason: FinishReason | None = None) -> None:
        """Finish a request wherever it is; its slots return to the pool."""
        self._post("abort", (rid, reason))

    def apply(self, change: Callable[[Scheduler], None]) -> None:
        """Run `change(scheduler)` between steps (e.g. attach or detach the host tier)."""
        self._post("apply", change)

    def flush(self) -> Future[bool]:
        """Drop every cached prefix; False while requests hold any."""
        return self.call(Scheduler.flush_cache)

    def info(self) -> Future[dict[str, int]]:
        """Pool, cache and queue occupancy, read between steps."""
        return self.call(Scheduler.stats)

    def call(self, ask: Callable[[Scheduler], T]) -> Future[T]:
        """`ask(scheduler)` run between steps: its result, or what it raised."""
        done: Future[T] = Future()
        self._post("call", (ask, done))
        return done

    def lose(self, lost: ExecutorLost) -> None:
        """The model runners are gone, noticed between steps: start over as if a step had
        failed (with an on_lost hook)."""
        self._post("lost", lost)

    def wake(self) -> None:
        """Run an iteration soon, e.g. to publish a refusal the sink holds."""
        self._post("wake", None)

    def stop(self) -> None:
        """Finish the step in flight, then return from `run()`."""
        self._stopping = True
        self._post("wake", None)

    def fail_pending(self, error: Exception) -> None:
        """After `run()` has returned: refuse what is still queued, fail pending calls."""
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "add":
                self.sink.refuse(payload, error)
            elif kind == "call":
                payload[1].set_exception(error)

    def _post(self, kind: str, payload: Any) -> None:
        self._inbox.append((kind, payload))
        loop = self._loop
        if loop is None:
            return  # run() has not started: it drains the inbox first
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            self._wake.set()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(self._wake.set)

    def _drain_inbox(self) -> None:
        sched = self.scheduler
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "add":
                try:
                    sched.add_request(payload)
                except ValueError as exc:
                    self.sink.refuse(payload, exc)
            elif kind == "abort":
                sched.abort(*payload)
            elif kind == "apply":
                payload(sched)
            elif kind == "call":
                ask, done = payload
                try:
                    done.set_result(ask(sched))
                except Exception as exc:
                    done.set_exception(exc)
            elif kind == "lost":
                raise payload

    # ---- the loop -------------------------------------------------------------------

    async def run(self) -> None:
        """Drive steps until `stop()`; the step in flight completes first."""
        self._loop = asyncio.get_running_loop()
        sched = self.scheduler
        in_flight: tuple[ScheduledBatch, Awaitable[StepResult]] | None = None
        # Nothing could be scheduled and nothing came back: what waits (for room, for its
        # prefix from storage) waits for news through the inbox, rather than spin.
        stalled = False
        while not self._stopping or in_flight is not None:
            if in_flight is None and (stalled or not sched.has_work()) and not self._inbox:
                self._wake.clear()
                await self._wake.wait()
            batch = submitted = None
            try:
                self._drain_inbox()
                batch = self._schedule() if not self._stopping else None
                stalled = batch is None and in_flight is None
                if self.overlap:
                    submitted = None if batch is None else (batch, self.executor.submit(batch))
                    if in_flight is not None:
                        sched.process_result(in_flight[0], await in_flight[1])
                    in_flight = submitted
                elif batch is not None:
                    sched.process_result(batch, await self.executor.submit(batch))
            except Exception as exc:
                # The other step fails too, or its result is void; awaited either way, so
                # that no failure goes unretrieved.
                for step in [s[1] for s in (in_flight, submitted) if s]:
                    with contextlib.suppress(Exception):
                        await step
                if not isinstance(exc, ExecutorLost) or self._on_lost is None:
                    raise
                in_flight = None
                await self._start_over(exc)
                continue
            await self.sink.publish(sched.drain_updates())

    async def _start_over(self, lost: ExecutorLost) -> None:
        """The model runners are gone: end every request with the reason, forget every
        cached prefix, and wait for the runners to come back."""
        ended = self.scheduler.lose_all(FinishReason(FinishKind.ABORT, message=str(lost)))
        await self.sink.publish(ended)
        assert self._on_lost is not None
        await self._on_lost(lost)

    def _schedule(self) -> ScheduledBatch | None:
        if self._on_schedule is None:
            return self.scheduler.schedule()
        started = time.time_ns()
        batch = self.scheduler.schedule()
        if batch is not None:
            self._on_schedule(batch, started, time.time_ns())
        return batch
