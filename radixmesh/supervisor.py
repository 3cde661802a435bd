"""Keeps the mesh's processes running: a service that exits is started again, with backoff,
while everything else keeps serving.

A replica restarted 5 times within 60 s is given up (logged), not the mesh; the mesh fails
only when every replica of a service it needs is given up. Processes of one group restart
together: an engine's worker ranks share one collective group, so when one dies the others
(stuck in a collective with it) are killed and all start again. The scheduler of that
engine notices its workers are gone, ends their requests and waits for them to come back
(services/scheduler/server.py)."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from prometheus_client import Counter, Gauge

log = logging.getLogger("radixmesh.supervisor")

RESTARTS = Counter("radixmesh:service_restarts_total",
                   "Times the supervisor started a service replica again", ("replica",))
GIVEN_UP = Gauge("radixmesh:services_given_up",
                 "Service replicas the supervisor stopped restarting")

RESTART_LIMIT = 5  # restarts within RESTART_WINDOW_S before a replica is given up
RESTART_WINDOW_S = 60.0
BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0)  # wait before the n-th restart in the window
CHECK_S = 0.25


@dataclass
class Process:
    """One replica of a service, and how to start it again."""

    name: str
    service: str
    group: str  # restarted together with the other processes of its group ("" : alone)
    start: Callable[[], subprocess.Popen[bytes]]
    proc: subprocess.Popen[bytes]
    health_url: str
    log: IO[bytes] | None = None
    required: bool = True  # the mesh cannot serve once every replica of it is given up
    restarts: list[float] = field(default_factory=list)  # when it was started again
    died_at: float | None = None  # when its exit was noticed
    given_up: bool = False

    def recent_restarts(self, now: float) -> int:
        return sum(now - t < RESTART_WINDOW_S for t in self.restarts)


class Supervisor:
    """Checks the processes every CHECK_S on a thread of its own between `start()` and
    `stop()`. `failed` says why the mesh cannot go on (None while it can)."""

    def __init__(self, processes: list[Process], clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.processes = processes
        self.clock = clock
        self.failed: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="radixmesh-supervisor",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop restarting (before the processes are stopped)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def restarts(self) -> dict[str, int]:
        """Times each process was started again."""
        return {p.name: len(p.restarts) for p in self.processes}

    def _run(self) -> None:
        while not self._stop.wait(CHECK_S):
            self.check()

    def check(self) -> None:
        """One pass: notice exits, restart what is due, give up what keeps failing."""
        with self._lock:
            now = self.clock()
            for p in self.processes:
                if p.given_up or p.died_at is not None:
                    continue
                code = p.proc.poll()
                if code is not None:
                    p.died_at = now
                    log.warning("%s exited with code %s", p.name, code)
                    self._stop_group(p)
            for p in self.processes:
                if p.died_at is not None and not p.given_up:
                    self._maybe_restart(p, now)
            self.failed = self._failure()

    def _stop_group(self, dead: Process) -> None:
        """The rest of its group cannot go on without it: stop them to start all again."""
        if not dead.group:
            return
        for p in self.processes:
            if p.group == dead.group and p is not dead and p.died_at is None:
                log.warning("%s stops too: it shares a group with %s", p.name, dead.name)
                p.proc.kill()
                p.proc.wait()
                p.died_at = dead.died_at

    def _maybe_restart(self, p: Process, now: float) -> None:
        recent = p.recent_restarts(now)
        if recent >= RESTART_LIMIT:
            p.given_up = True
            GIVEN_UP.inc()
            log.error("%s failed %d times within %.0f s; giving up on it", p.name, recent + 1,
                      RESTART_WINDOW_S)
            return
        assert p.died_at is not None
        if now - p.died_at < BACKOFF_S[min(recent, len(BACKOFF_S) - 1)]:
            return
        p.proc = p.start()
        p.restarts.append(now)
        p.died_at = None
        RESTARTS.labels(p.name).inc()
        log.warning("%s restarted (restart %d)", p.name, len(p.restarts))

    def _failure(self) -> str | None:
        services: dict[str, list[Process]] = {}
        for p in self.processes:
            if p.required:
                services.setdefault(p.service, []).append(p)
        for service, replicas in services.items():
            if all(p.given_up for p in replicas):
                return f"every {service} replica failed"
        return None
