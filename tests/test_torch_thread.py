"""The torch thread's OpenMP team: kept while work is queued, released (its threads gone) as
soon as the thread runs out of work, and started again by the next parallel region."""

from __future__ import annotations

import os
import threading

import torch

from radixmesh.engine.model.torch_thread import TorchThread


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_work() -> None:
    a = torch.ones(256, 256)
    for _ in range(4):
        a @ a


def test_the_team_leaves_when_the_queue_empties_and_comes_back() -> None:
    thread = TorchThread("test-torch", num_threads=2)
    try:
        thread.submit(lambda: None).result()  # the executor's own thread, started
        alone = _threads()
        during = thread.submit(lambda: (_parallel_work(), _threads())[1]).result()
        assert during == alone + 1  # the team: the torch thread and one more
        assert _threads() == alone  # released once nothing was queued
        assert thread.submit(lambda: (_parallel_work(), _threads())[1]).result() == during
    finally:
        thread.shutdown()


def test_the_team_stays_while_work_is_queued() -> None:
    thread = TorchThread("test-torch", num_threads=2)
    gate = threading.Event()
    try:
        thread.submit(lambda: None).result()
        alone = _threads()
        first = thread.submit(lambda: (_parallel_work(), gate.wait(10)))
        second = thread.submit(_threads)  # queued behind the first: no release between
        gate.set()
        first.result()
        assert second.result() == alone + 1
    finally:
        thread.shutdown()
