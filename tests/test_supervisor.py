"""The supervisor on real child processes and a fake clock: a dead replica is restarted with
backoff, a worker group restarts together, a replica failing 5 times in 60 s is given up,
and the mesh fails only when every replica of a needed service is given up."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tiny_model import save_tiny_model, save_word_tokenizer

from radixmesh.supervisor import Process, Supervisor

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]
EXIT = [sys.executable, "-c", "raise SystemExit(3)"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def process(spawned: list, name: str, service: str, argv: list[str], group: str = "",
            required: bool = True) -> Process:
    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv)
        spawned.append(proc)
        return proc

    return Process(name, service, group, start, start(), "", required=required)


def settle(p: Process) -> None:
    p.proc.wait(timeout=30)


def test_a_dead_replica_is_restarted_with_backoff(spawned):
    clock = Clock()
    crashing = process(spawned, "tokenizer-0", "tokenizer", EXIT)
    steady = process(spawned, "tokenizer-1", "tokenizer", SLEEP)
    sup = Supervisor([crashing, steady], clock)
    settle(crashing)
    sup.check()  # noticed and restarted at once (first restart: no wait)
    assert sup.restarts() == {"tokenizer-0": 1, "tokenizer-1": 0}
    settle(crashing)
    sup.check()  # dies again: the second restart waits 1 s
    assert sup.restarts()["tokenizer-0"] == 1
    clock.now += 1.1
    sup.check()
    assert sup.restarts()["tokenizer-0"] == 2
    assert steady.proc.poll() is None and sup.failed is None


def test_one_dead_worker_restarts_its_whole_group(spawned):
    clock = Clock()
    rank0 = process(spawned, "worker-0.0", "worker", SLEEP, group="workers-0")
    rank1 = process(spawned, "worker-0.1", "worker", SLEEP, group="workers-0")
    other = process(spawned, "worker-1.0", "worker", SLEEP, group="workers-1")
    sup = Supervisor([rank0, rank1, other], clock)
    first_rank0 = rank0.proc
    rank1.proc.kill()
    settle(rank1)
    sup.check()
    assert first_rank0.poll() is not None  # killed with its group
    assert sup.restarts() == {"worker-0.0": 1, "worker-0.1": 1, "worker-1.0": 0}
    assert rank0.proc.poll() is None and rank1.proc.poll() is None


def test_a_replica_failing_5_times_in_60_s_is_given_up_and_then_the_mesh(spawned):
    clock = Clock()
    crashing = process(spawned, "detokenizer-0", "detokenizer", EXIT)
    cache = process(spawned, "cachectl-0", "cachectl", EXIT, required=False)
    sup = Supervisor([crashing, cache], clock)
    for _ in range(12):
        settle(crashing)
        settle(cache)
        sup.check()  # notices the exits
        clock.now += 9  # past every backoff: 5 restarts fit in the 60 s window
        sup.check()
    assert crashing.given_up and cache.given_up
    assert sup.restarts() == {"detokenizer-0": 5, "cachectl-0": 5}
    # The cache owner is optional; the only detokenizer is not.
    assert sup.failed == "every detokenizer replica failed"


def test_restarts_spread_over_time_are_never_given_up(spawned):
    clock = Clock()
    crashing = process(spawned, "scheduler-0", "scheduler", EXIT)
    sup = Supervisor([crashing], clock)
    for _ in range(8):
        settle(crashing)
        sup.check()  # notices the exit
        clock.now += 20  # 3 restarts per 60 s at most
        sup.check()
    assert not crashing.given_up and sup.restarts()["scheduler-0"] == 8
    assert sup.failed is None


def test_ctrl_c_stops_the_whole_mesh_without_a_traceback(tmp_path: Path) -> None:
    """Ctrl-C in a terminal signals `radixmesh up`'s whole process group: the launcher stops
    the services in order and the embedded NATS server last, so no service's drain meets a
    NATS server that is already gone."""
    model = save_tiny_model(tmp_path / "model")
    save_word_tokenizer(model)
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "radixmesh.cli", "up", "--model-path", str(model),
             "--port", "0", "--grpc-port", "0", "--device", "cpu"],
            stdout=stdout, stderr=stderr, start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 240
            while "serving at" not in out.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
                time.sleep(0.5)
            os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    log = err.read_text()
    assert "Traceback" not in log and "Error" not in log, log[-3000:]
    assert "radixmesh: stopping" in out.read_text()
    assert re.search(r"^radixmesh: ready in \d+\.\d s$", out.read_text(), re.M)
