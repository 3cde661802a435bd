"""`python -m radixmesh.services.worker`: one worker rank."""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import MutableMapping

from radixmesh.core.service_settings import WorkerConfig
from radixmesh.mesh.service import configure_service, run_service, run_until_stopped, stop_event

log = logging.getLogger("radixmesh.worker")

# OpenMP threads out of work spin before they sleep. libgomp's default, 300,000 spins, is
# milliseconds: after every step a core spins on, taking it from the services beside the
# worker (on two cores, a 1-layer model's mesh served 2.3x the tokens with 1,000 spins). A
# thousand spins (tens of microseconds) still bridge the gaps between a forward's parallel
# regions. Read when torch loads libgomp; GOMP_SPINCOUNT or OMP_WAIT_POLICY set by the
# user win.
SPIN_COUNT = "1000"


def spin_briefly(env: MutableMapping[str, str]) -> None:
    """Set the worker's OpenMP spin count in `env` unless the user chose a wait policy."""
    if "OMP_WAIT_POLICY" not in env:
        env.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)


async def _main(config: WorkerConfig) -> bool:
    """Serve until SIGTERM/SIGINT; whether the torch thread settled on the way out."""
    from radixmesh.services.worker.server import WorkerService  # loads torch

    stop = stop_event()
    service = WorkerService(config)
    try:
        if await run_until_stopped(service.start(), stop):
            await stop.wait()
    finally:
        settled = await service.stop()
    return settled


def main() -> None:
    spin_briefly(os.environ)
    config = configure_service(
        WorkerConfig, "worker", lambda c: f"rank{c.tp_rank}-{platform.node()}-{os.getpid()}"
    )
    if not run_service(_main(config)):
        # A thread blocked in a collective on a dead peer would hold the interpreter's exit.
        os._exit(0)
    log.info("worker rank %d stopped", config.tp_rank)


if __name__ == "__main__":
    main()
