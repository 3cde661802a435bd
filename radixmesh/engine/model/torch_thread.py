"""The one thread that runs every torch call of a model runner, and its OpenMP team.

A second thread running parallel torch ops would start a second OpenMP team, and the two
slow each other down by ~1.5x: so every torch call goes through this thread. Its team's
threads spin between the parallel regions of a step (libgomp's default spin, ~10 ms), so a
step never waits for a sleeping thread to wake; and when the thread has nothing queued, the
team is released (OpenMP's omp_pause_resource_all: its threads end, the next parallel region
starts them again, ~0.1 ms), so a core is never spun away from the processes beside it while
the model has no work."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

T = TypeVar("T")
_OMP_PAUSE_SOFT = 1


def _pause_call() -> Callable[[], Any] | None:
    """omp_pause_resource_all(omp_pause_soft) of the OpenMP runtime torch loaded; None where
    it has none by that name (a runtime other than libgomp, or one before OpenMP 5.0)."""
    try:
        runtime = ctypes.CDLL("libgomp.so.1")  # torch's, already loaded: same soname
        pause = runtime.omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return lambda: pause(_OMP_PAUSE_SOFT)


def _set_threads(num_threads: int) -> None:
    # On the thread itself: OpenMP's thread count is per calling thread.
    if num_threads > 0:
        torch.set_num_threads(num_threads)


class TorchThread(ThreadPoolExecutor):
    """A one-thread executor whose OpenMP team leaves the cores whenever its queue empties.
    `num_threads` > 0 sets the team's size (torch.set_num_threads on the thread)."""

    def __init__(self, name: str, num_threads: int = 0) -> None:
        super().__init__(1, name, initializer=_set_threads, initargs=(num_threads,))
        self._pause = _pause_call()
        self._lock = threading.Lock()
        self._pending = 0  # submitted and not yet finished

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        with self._lock:
            self._pending += 1
        try:
            return super().submit(self._run, fn, args, kwargs)
        except BaseException:
            with self._lock:
                self._pending -= 1
            raise

    def _run(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            with self._lock:
                self._pending -= 1
                idle = not self._pending
            if idle and self._pause is not None:
                self._pause()
