"""`python -m radixmesh.services.worker`: one worker rank."""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import MutableMapping

from radixmesh.core.model_files import mlp_work, resolve_model_path
from radixmesh.core.service_settings import WorkerConfig
from radixmesh.mesh.service import configure_service, run_service, run_until_stopped, stop_event

log = logging.getLogger("radixmesh.worker")

# How long an OpenMP thread out of work spins before it sleeps: libgomp reads it once, when
# torch loads it. A layer of a real model keeps the threads busy back to back, and a thread
# that sleeps between two parallel regions costs a wake-up (the bundled model served ~10% fewer
# tokens at 8 streams with 1,000 spins, 10 us on a Xeon, than with libgomp's 300,000, 3 ms).
# A tiny model's step is mostly host work between sparse regions, where the long spin takes a
# core from the services beside the worker (a 1-layer, 64-wide model's mesh served half the
# tokens with it). So a worker spins briefly for a model whose layers are that small; the
# torch thread releases its team whenever it runs out of work (TorchThread) either way.
SMALL_MLP_WORK = 1 << 18  # multiply-adds of one layer's MLP for one token
SHORT_SPIN = "1000"


def openmp_spin(env: MutableMapping[str, str], model_path: str | None) -> None:
    """Set a short spin in `env` for a small model, unless the user chose a wait policy."""
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return
    try:
        work = mlp_work(resolve_model_path(model_path))
    except (OSError, ValueError):
        return  # the load reports it
    if work is not None and work < SMALL_MLP_WORK:
        env["GOMP_SPINCOUNT"] = SHORT_SPIN


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
    config = configure_service(
        WorkerConfig, "worker", lambda c: f"rank{c.tp_rank}-{platform.node()}-{os.getpid()}"
    )
    openmp_spin(os.environ, config.model_path)
    if not run_service(_main(config)):
        # A thread blocked in a collective on a dead peer would hold the interpreter's exit.
        os._exit(0)
    log.info("worker rank %d stopped", config.tp_rank)


if __name__ == "__main__":
    main()
