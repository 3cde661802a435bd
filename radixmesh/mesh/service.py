"""The lifecycle every mesh service shares: one config line at start, /health and
/metrics over HTTP, a NATS connection that rides out NATS restarts, and a clean stop on
SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import nats
import uvloop
from aiohttp import web
from nats.aio.client import Client as NATS
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from radixmesh.core.bus import bus_servers
from radixmesh.core.flags import parse_config, shown
from radixmesh.core.service_settings import ServiceSettings
from radixmesh.tracing import init_tracing

C = TypeVar("C", bound=ServiceSettings)
T = TypeVar("T")

HealthCheck = Callable[[], tuple[bool, dict[str, Any]]]


def configure_service(config_cls: type[C], service: str, instance: Callable[[C], str]) -> C:
    """What every service's main does first: its config from flags and RADIXMESH_* variables
    (a bad value exits 2 with the reason), logging (one line per record, logger name first,
    as the launcher interleaves them), the one start-up line with the whole config as JSON,
    and tracing as `service` with the instance id `instance(config)`."""
    config = parse_config(config_cls, prog=f"radixmesh-{service}")
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    fields = shown(config)
    logging.getLogger(f"radixmesh.{service}").info(
        "%s starting with config %s", service, json.dumps(fields, default=str)
    )
    init_tracing(service, instance(config))
    return config


async def connect_bus(
    url: str, name: str, on_reconnect: Callable[[], Awaitable[None]] | None = None
) -> NATS:
    """Connect to NATS (`url`: a server, or a comma-separated list of a cluster's) as
    `name` (credentials in the URL are used), reconnecting forever every second while it
    is away, to any server of the cluster (logged); `on_reconnect` runs once it is back
    (subscriptions come back by themselves)."""
    bus = logging.getLogger("radixmesh.nats")

    async def error(exc: Exception) -> None:
        bus.warning("%s: NATS: %s", name, exc)

    async def disconnected() -> None:
        bus.warning("%s: NATS connection lost; reconnecting", name)

    async def reconnected() -> None:
        bus.info("%s: NATS connection back", name)
        if on_reconnect is not None:
            await on_reconnect()

    return await nats.connect(
        bus_servers(url), name=name, max_reconnect_attempts=-1, reconnect_time_wait=1.0,
        error_cb=error, disconnected_cb=disconnected, reconnected_cb=reconnected,
    )


def run_service(main: Coroutine[Any, Any, T]) -> T:
    """Run a service's main coroutine to its end on uvloop's event loop: libuv's sockets,
    timers and callbacks take less CPU per message than asyncio's own loop, and every token
    crosses three services' loops."""
    return uvloop.run(main)


def stop_event() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (call from inside the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


# Net allocations of tracked objects between collections of the youngest generation
# (Python's default: 700). A service allocates per token and frees nearly all of it at once
# by reference counting, yet at 700 the tokenizer's collector ran about 200 times a second
# serving 256 streams, a tenth of its CPU.
YOUNG_GC_THRESHOLD = 10_000


def settle_heap() -> None:
    """Once a service has started: what start-up made leaves the collector's sight (it
    lives as long as the process), and the youngest generation is collected less often."""
    gc.freeze()
    gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])


async def run_until_stopped(start: Awaitable[None], stop: asyncio.Event) -> bool:
    """Run a service's start-up unless a stop signal comes first (then it is cancelled);
    once started, settle its heap."""
    task = asyncio.ensure_future(start)
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task.done():
        task.result()
        settle_heap()
        return True
    task.cancel()
    return False


async def metrics_response(_: web.Request) -> web.Response:
    """Prometheus text exposition of this process's metrics."""
    body = generate_latest()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def health_handler(check: HealthCheck) -> Callable[[web.Request], Awaitable[web.Response]]:
    """GET /health: 200 with details when ready, 503 otherwise."""

    async def handle(_: web.Request) -> web.Response:
        ok, details = check()
        return web.json_response({"status": "ok" if ok else "starting", **details},
                                 status=200 if ok else 503)

    return handle


class StatusServer:
    """/health and /metrics for services that have no HTTP API of their own."""

    def __init__(self, host: str, port: int, check: HealthCheck) -> None:
        self.host, self.port = host, port
        app = web.Application()
        app.router.add_get("/health", health_handler(check))
        app.router.add_get("/metrics", metrics_response)
        self._runner = web.AppRunner(app, access_log=None)

    async def start(self) -> None:
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]  # the real one when asked for port 0

    async def stop(self) -> None:
        await self._runner.cleanup()
