"""Workers and schedulers find each other on NATS (a real nats-server with JetStream): a
scheduler claims only a group whose every rank is announced, two schedulers never share a
group, a restarted scheduler (same engine id) gets its group back at once, a claim or
announcement is gone once withdrawn, and a scheduler claims only workers of its own
disaggregation mode; and, with the real model, an engine started by hand
joins a running mesh through them."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import httpx
import nats
import pytest
from process_helpers import running_mesh, service_process

from radixmesh.mesh.discovery import (
    CLAIMS_BUCKET,
    WORKERS_BUCKET,
    Announcer,
    WorkerRank,
    announced,
    bucket,
    claim_workers,
    keep_claim,
    key_part,
)
from radixmesh.mesh.nats_server import EmbeddedNats


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    with EmbeddedNats(jetstream=True) as server:
        yield server.url


async def wait_for(check, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "not within the timeout"
        await asyncio.sleep(0.05)


def test_group_names_become_key_tokens():
    assert key_part("tcp://10.0.0.7:29500") == "tcp___10_0_0_7_29500"
    assert WorkerRank("10.0.0.7:50051", 0, 1, "10.0.0.7:50051").key == "10_0_0_7_50051.0"


async def run_claims(url: str) -> None:
    nc = await nats.connect(url)
    tp = [Announcer(url, WorkerRank("tcp://h:1", r, 2, f"h:{5000 + r}")) for r in range(2)]
    single = Announcer(url, WorkerRank("h:6000", 0, 1, "h:6000"))
    try:
        tp[1].start()  # rank 0 of the pair is not there yet: nothing to claim
        await wait_for(lambda: _has(nc, "tcp://h:1"))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(claim_workers(nc, "a"), 1.5)

        tp[0].start()
        single.start()
        await wait_for(lambda: _has(nc, "h:6000"))
        first = await claim_workers(nc, "a", prefer="tcp://h:1")
        assert (first.group, first.addrs) == ("tcp://h:1", ["h:5000", "h:5001"])
        second = await claim_workers(nc, "b")  # the pair is a's: b gets the other group
        assert (second.group, second.addrs) == ("h:6000", ["h:6000"])
        with pytest.raises(TimeoutError):  # nothing is left for a third engine
            await asyncio.wait_for(claim_workers(nc, "c"), 1.5)
        again = await claim_workers(nc, "a")  # a restarted: its own claim is taken over
        assert again.group == "tcp://h:1"

        keeper = asyncio.create_task(keep_claim(nc, second, "b"))
        await asyncio.sleep(0.1)
        keeper.cancel()  # b stops: its group is released at once
        await asyncio.gather(keeper, return_exceptions=True)
        third = await asyncio.wait_for(claim_workers(nc, "c"), 5)
        assert third.group == "h:6000"

        await single.close()  # withdrawn: no longer listed
        assert "h:6000" not in await announced(nc)
    finally:
        for a in [*tp, single]:
            await a.close()
        await nc.close()


async def _has(nc: nats.NATS, group: str) -> bool:
    return group in await announced(nc)


def test_schedulers_claim_free_complete_groups(nats_url):
    asyncio.run(run_claims(nats_url))


async def run_role_claims(url: str) -> None:
    nc = await nats.connect(url)
    prefill = Announcer(url, WorkerRank("p:7000", 0, 1, "p:7000", "prefill"))
    decode = Announcer(url, WorkerRank("d:7100", 0, 1, "d:7100", "decode"))
    workers, claims = await bucket(nc, WORKERS_BUCKET), await bucket(nc, CLAIMS_BUCKET)
    # As a worker from before disaggregation stored it: no mode, so it is a "null" one.
    await workers.put("old_7200.0", b'{"group": "old:7200", "rank": 0, "tp_size": 1, '
                                    b'"addr": "old:7200"}')
    try:
        prefill.start()
        decode.start()
        await wait_for(lambda: _has(nc, "p:7000"))
        await wait_for(lambda: _has(nc, "d:7100"))
        assert (await announced(nc))["old:7200"][0].disaggregation_mode == "null"

        # Asked for the decode group, a prefill scheduler still gets the prefill one.
        p = await claim_workers(nc, "p0", prefer="d:7100", disaggregation_mode="prefill")
        assert (p.group, p.addrs) == ("p:7000", ["p:7000"])
        with pytest.raises(TimeoutError):  # the decode group is free, but not for prefill
            await asyncio.wait_for(claim_workers(nc, "p1", disaggregation_mode="prefill"), 1.5)
        d = await claim_workers(nc, "d0", disaggregation_mode="decode")
        assert (d.group, d.addrs) == ("d:7100", ["d:7100"])
        plain = await claim_workers(nc, "e0")  # a "null" scheduler: only the mode-less one
        assert plain.group == "old:7200"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(claim_workers(nc, "e1"), 1.5)
    finally:
        for a in (prefill, decode):
            await a.close()
        await workers.delete("old_7200.0")
        for group in ("p:7000", "d:7100", "old:7200"):  # no claim left for later tests
            await claims.delete(key_part(group))
        await nc.close()


def test_schedulers_claim_only_workers_of_their_disaggregation_mode(nats_url):
    asyncio.run(run_role_claims(nats_url))


def engine_states(url: str) -> dict[str, dict]:
    try:
        info = httpx.get(url + "/server_info", timeout=10).json()
    except httpx.HTTPError:
        return {}
    return {s["engine_id"]: s for s in info["internal_states"]}


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} not within {timeout:.0f} s"
        time.sleep(0.5)


def test_an_engine_started_by_hand_joins_a_running_mesh(tmp_path):
    """`radixmesh up` (one engine) and, beside it, a worker and a scheduler started by hand
    with nothing but the mesh's NATS: the scheduler claims the worker, the tokenizers route
    to both engines, and a scheduler started again after a clean stop gets the same worker
    back at once."""
    model = ["--dtype", "float32", "--max-total-tokens", "2048"]
    with running_mesh(tmp_path, dtype="float32", max_total_tokens=2048) as mesh:
        env = {**os.environ, "NATS_URL": mesh.nats_url}
        with service_process("radixmesh.services.worker", *model, "--announce", "true",
                             env=env):
            for engine in ("by-hand", "by-hand-again"):
                with service_process("radixmesh.services.scheduler", "--engine-id", engine,
                                     env=env) as scheduler:
                    wait_until(lambda e=engine: e in engine_states(mesh.url), 120,
                               f"engine {engine} serving")
                    body = {"sampling_params": {"temperature": 0, "max_new_tokens": 6,
                                                "ignore_eos": True}}
                    for i in range(8):
                        reply = httpx.post(mesh.url + "/generate", timeout=60, json={
                            "text": f"Topic {i} of {engine}: {'lorem ' * (8 * i)}", **body})
                        assert reply.json()["meta_info"]["completion_tokens"] == 6
                    states = engine_states(mesh.url)
                    assert set(states) == {"e0", engine}
                    assert states[engine]["steps"] > 0 and states["e0"]["steps"] > 0
                    assert states[engine]["held_slots"] == 0
                    scheduler.terminate()  # a clean stop releases its claim
                    assert scheduler.wait(30) == 0
                    # Routers drop an engine a few seconds after its last heartbeat: the
                    # next one's check must not race that.
                    wait_until(lambda e=engine: e not in engine_states(mesh.url), 30,
                               f"engine {engine} dropped by the routers")
