"""One replica's death never takes the mesh down (`radixmesh up`, two of everything, the real
model): SIGKILL a worker, a detokenizer, a scheduler and a tokenizer, each under load. No
request hangs; those of the killed replica end with a clear error (or are retried, when
they had no output yet); the others complete with their exact token counts; new requests
succeed within 10 s; the supervisor restarts the replica and it serves again. NATS stopped
and started again under load: the same, every service reconnecting by itself."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from process_helpers import running_mesh

from radixmesh.launcher import Mesh

NEW_TOKENS = 48
BODY = {"sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> Iterator[Mesh]:
    log_dir = tmp_path_factory.mktemp("resilience-logs")
    with running_mesh(log_dir, dp_size=2, detokenizers=2, tokenizers=2, dtype="float32",
                      max_total_tokens=4096) as m:
        yield m


def kill(mesh: Mesh, name: str) -> None:
    child = next(c for c in mesh.children if c.name == name)
    os.kill(child.proc.pid, signal.SIGKILL)


def engines(url: str) -> list[str]:
    try:
        return httpx.get(url + "/server_info", timeout=10).json()["engines"]
    except httpx.HTTPError:
        return []


def wait_until(check, timeout: float, what: str) -> float:
    """Seconds until check() holds; fails after `timeout`."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, f"{what} not within {timeout:.0f} s"
        time.sleep(0.2)
    return time.monotonic() - start


def outcome(reply: httpx.Response) -> tuple[str, str | int]:
    """("ok", completion tokens) or ("error", the message a client sees)."""
    body = reply.json()
    if reply.status_code != 200:
        return "error", body["error"]["message"]
    finish = body["meta_info"]["finish_reason"]
    if finish["type"] == "abort":
        return "error", finish["message"]
    return "ok", body["meta_info"]["completion_tokens"]


def under_load(mesh: Mesh, victim: str | Callable[[], None], url: str | None = None,
               n: int = 8) -> list[tuple[str, str | int]]:
    """n requests at once; the victim is killed (or called) once they are under way."""
    target = url or mesh.url

    async def run() -> list[tuple[str, str | int]]:
        async with httpx.AsyncClient(base_url=target, timeout=120) as client:
            calls = [asyncio.create_task(client.post(
                "/generate", json={"text": f"Story {i}: once upon a time", **BODY}))
                for i in range(n)]
            await asyncio.sleep(1.5)
            if callable(victim):
                await asyncio.to_thread(victim)
            else:
                kill(mesh, victim)
            replies = await asyncio.gather(*calls, return_exceptions=True)
        return [("error", f"{type(r).__name__}") if isinstance(r, BaseException)
                else outcome(r) for r in replies]

    started = time.monotonic()
    results = asyncio.run(run())
    assert time.monotonic() - started < 60, "a request hung"
    return results


def serves(url: str) -> bool:
    try:
        reply = httpx.post(url + "/generate", json={"text": "Hello", **BODY}, timeout=30)
    except httpx.HTTPError:
        return False
    return outcome(reply) == ("ok", NEW_TOKENS)


def check_recovery(mesh: Mesh, name: str, results: list[tuple[str, str | int]]) -> None:
    completed = [n for kind, n in results if kind == "ok"]
    assert all(n == NEW_TOKENS for n in completed), results
    assert completed, results  # the other replica's requests went through
    assert wait_until(lambda: serves(mesh.url), 10, "a new request served") < 10
    wait_until(lambda: mesh.supervisor.restarts()[name] >= 1, 30, f"{name} restarted")
    wait_until(lambda: len(engines(mesh.url)) == 2, 90, "both engines back")
    for _ in range(4):  # both engines serve again
        assert serves(mesh.url)


def restarts_counted(mesh: Mesh, replica: str) -> float:
    """The launcher's restart counter of `replica` (one per process: another mesh started
    by this test process counts under the same name too)."""
    prefix = f'radixmesh:service_restarts_total{{replica="{replica}"}} '
    text = httpx.get(mesh.metrics_url, timeout=10).text
    return next((float(line[len(prefix):]) for line in text.splitlines()
                 if line.startswith(prefix)), 0.0)


def test_a_killed_worker(mesh):
    counted = restarts_counted(mesh, "worker-1.0")
    results = under_load(mesh, "worker-1.0")
    errors = [m for kind, m in results if kind == "error"]
    assert all("engine e1 lost its worker" in m for m in errors), errors
    check_recovery(mesh, "worker-1.0", results)
    assert restarts_counted(mesh, "worker-1.0") == counted + 1


def test_a_killed_detokenizer(mesh):
    results = under_load(mesh, "detokenizer-1")
    errors = [m for kind, m in results if kind == "error"]
    assert all("a detokenizer went away" in m for m in errors), errors
    check_recovery(mesh, "detokenizer-1", results)


def test_a_killed_scheduler(mesh):
    results = under_load(mesh, "scheduler-0")
    errors = [m for kind, m in results if kind == "error"]
    # Noticed as silent, or as restarted when the new process speaks up first.
    assert all("engine e0 went away" in m or "engine e0 restarted" in m for m in errors), errors
    check_recovery(mesh, "scheduler-0", results)


def test_a_killed_tokenizer(mesh):
    second = mesh.http_urls[1]
    results = under_load(mesh, "tokenizer-1", url=second)
    assert all(kind == "error" for kind, _ in results), results  # its clients lost it
    assert serves(mesh.url)  # the other tokenizer never stopped
    wait_until(lambda: serves(second), 60, "the tokenizer back on its port")
    assert mesh.supervisor.restarts()["tokenizer-1"] == 1


def test_nats_stopped_and_started_again(mesh):
    assert mesh.nats is not None and mesh.supervisor is not None
    restarts = sum(mesh.supervisor.restarts().values())

    def short_request_served() -> bool:
        body = {"text": "Hi", "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
        try:
            reply = httpx.post(mesh.url + "/generate", json=body, timeout=10)
        except httpx.HTTPError:
            return False
        return outcome(reply)[0] == "ok"

    served_after: list[float] = []

    def outage() -> None:
        mesh.nats.stop()
        time.sleep(3)
        mesh.nats.start()
        served_after.append(
            wait_until(short_request_served, 10, "a new request served after NATS is back"))

    results = under_load(mesh, outage)
    for kind, message in results:
        assert kind == "ok" or "message bus was interrupted" in message or "went away" in \
            message, results
    assert all(n == NEW_TOKENS for kind, n in results if kind == "ok"), results
    assert served_after[0] < 10
    wait_until(lambda: len(engines(mesh.url)) == 2, 30, "both engines heard again")
    assert sum(mesh.supervisor.restarts().values()) == restarts  # no service died of it
