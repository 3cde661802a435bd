"""Steps launched ahead of their reads: a launched step (PendingStep) gives its result once
the host has read its tokens, and LaunchAhead runs the steps on the torch thread so that
each is launched before the one before it is read."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from radixmesh.core.step import StepResult

if TYPE_CHECKING:
    from radixmesh.engine.model.step_sampler import TokenRead


class PendingStep:
    """A launched step: its result, once the host has read its tokens. Its forward_ms counts
    the launch and the wait for the tokens, not the time between (another step's)."""

    def __init__(self, result: StepResult, read: TokenRead | None) -> None:
        self._result, self._read = result, read

    def ready(self) -> bool:
        """Whether result() would not wait for the device."""
        return self._read is None or self._read.ready()

    def result(self) -> StepResult:
        if self._read is not None:
            began = time.perf_counter()
            self._read()
            self._read = None
            self._result.forward_ms += (time.perf_counter() - began) * 1e3
        return self._result


R = TypeVar("R", covariant=True)


class Launched(Protocol[R]):
    """A step launched on the torch thread (a PendingStep, or what wraps one)."""

    def ready(self) -> bool: ...

    def result(self) -> R: ...


# How often a read waiting for the device looks for a launch queued behind it.
READ_POLL_S = 50e-6


class LaunchAhead(Generic[R]):
    """Runs steps on the one torch thread, in the order submitted, launching each before the
    one before it is read (ModelRunner.launch): while the host waits for a step's tokens,
    the next step is already queued on the GPU. A read still waiting for the device gives
    way to a launch submitted meanwhile, which reads it after launching. On the CPU a
    launch computes the whole step, and nothing changes."""

    def __init__(self, torch_thread: ThreadPoolExecutor) -> None:
        self._thread = torch_thread
        # The step launched last, not read yet, and its future (torch thread only).
        self._launched: tuple[Launched[R], Future[R]] | None = None
        self._queued: deque[None] = deque()  # one per launch submitted and not yet run

    def submit(self, launch: Callable[[], Launched[R]]) -> Awaitable[R]:
        """Queue the launch and, behind it, the read of its tokens (which a later launch
        queued meanwhile does instead); the step's result, awaitable on the calling loop."""
        done: Future[R] = Future()
        self._queued.append(None)
        self._thread.submit(self._launch, launch, done)
        self._thread.submit(self._read, done)
        return asyncio.wrap_future(done)

    def _launch(self, launch: Callable[[], Launched[R]], done: Future[R]) -> None:
        self._queued.popleft()
        try:
            step = launch()
        except BaseException as exc:
            self._read(None)
            done.set_exception(exc)
            return
        launched, self._launched = self._launched, (step, done)
        if launched is not None:
            _settle(*launched)

    def _read(self, done: Future[R] | None) -> None:
        """Read the step launched last, if it is `done`'s (None: whichever, at once)."""
        launched = self._launched
        if launched is None or (done is not None and launched[1] is not done):
            return
        if done is not None:
            while not launched[0].ready():
                if self._queued:
                    return  # the launch queued behind this read reads the step
                time.sleep(READ_POLL_S)
        self._launched = None
        _settle(*launched)


def _settle(step: Launched[R], done: Future[R]) -> None:
    try:
        done.set_result(step.result())
    except BaseException as exc:
        done.set_exception(exc)
