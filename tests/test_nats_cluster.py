"""The mesh on a three-node NATS cluster (`--nats-url` a list of its servers): the discovery
bucket and the storage tier's object store keep a replica on each node; one node killed
under load: no request hangs, the mesh serves on, a worker's announcement stays renewed
past its expiry (discovery keeps working) and nothing stored is lost."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable

import httpx
import nats
from process_helpers import nats_cluster, running_mesh
from test_resilience import outcome, wait_until
from tiny_model import save_tiny_model, save_word_tokenizer

from radixmesh.engine.stores.storage import NatsBackend
from radixmesh.mesh.discovery import TTL_S, WORKERS_BUCKET, Announcer, WorkerRank

NEW_TOKENS = 200  # the tiny model serves 256 positions; prompts are 12 tokens
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
PAGE_KEY, PAGE = "0123456789abcdef" * 2, os.urandom(4096)
STORE = "radixmesh_cluster_test"


RANK = WorkerRank(group="127.0.0.1:1", rank=0, tp_size=1, addr="127.0.0.1:1")


async def announced(url: str) -> bool:
    """Whether RANK's announcement is in the workers bucket."""
    nc = await nats.connect(url.split(","))
    try:
        kv = await nc.jetstream().key_value(WORKERS_BUCKET)
        await kv.get(RANK.key)
        return True
    except (nats.js.errors.BucketNotFoundError, nats.js.errors.KeyNotFoundError,
            nats.errors.TimeoutError):  # not created yet, or a stream leader being elected
        return False
    finally:
        await nc.close()


async def replicas(url: str) -> tuple[int, int]:
    """Replicas of the workers bucket and of the test's object store."""
    nc = await nats.connect(url.split(","))
    try:
        js = nc.jetstream()
        workers = await (await js.key_value(WORKERS_BUCKET)).status()
        store = await (await js.object_store(STORE)).status()
        return workers.stream_info.config.num_replicas, store.stream_info.config.num_replicas
    finally:
        await nc.close()


async def put_page(url: str) -> None:
    backend = NatsBackend(url, STORE)
    await backend.connect()
    await backend.put(PAGE_KEY, PAGE)
    await backend.close()


async def get_page(url: str) -> bytes | None:
    backend = NatsBackend(url, STORE)
    await backend.connect()
    try:
        page = await backend.get(PAGE_KEY)
        return None if page is None else bytes(page)
    finally:
        await backend.close()


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float) -> None:
    """Until check() holds; AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"not within {timeout} s"
        await asyncio.sleep(0.2)


def generate(url: str, seed: int) -> tuple[str, str | int]:
    body = {"input_ids": [(seed * 7 + i) % 200 + 2 for i in range(12)], "sampling_params": GREEDY}
    return outcome(httpx.post(url + "/generate", json=body, timeout=60))


def test_a_node_killed_under_load(tmp_path):
    model = save_tiny_model(tmp_path / "model")
    save_word_tokenizer(model)
    with nats_cluster(3) as nodes:
        url = ",".join(node.url for node in nodes)
        asyncio.run(put_page(url))
        with running_mesh(tmp_path / "logs", model_path=str(model), dtype="float32",
                          max_total_tokens=4096, nats_url=url) as mesh:
            assert mesh.nats is None  # the cluster is the bus, nothing embedded
            assert generate(mesh.url, 0) == ("ok", NEW_TOKENS)

            async def scenario() -> list[tuple[str, str | int]]:
                announcer = Announcer(url, RANK)
                announcer.start()
                await eventually(lambda: announced(url), 30)
                assert await replicas(url) == (3, 3)
                calls = [asyncio.create_task(asyncio.to_thread(generate, mesh.url, i))
                         for i in range(8)]
                await asyncio.sleep(0.5)
                os.kill(nodes[0].pid, signal.SIGKILL)
                assert not all(call.done() for call in calls)  # killed under load
                results = await asyncio.gather(*calls)
                # Still there past its expiry: renewed on the nodes left.
                await asyncio.sleep(TTL_S + 2)
                await eventually(lambda: announced(",".join(n.url for n in nodes[1:])), 5)
                await announcer.close()
                return results

            started = time.monotonic()
            results = asyncio.run(scenario())
            assert time.monotonic() - started < 60 + TTL_S, "a request hung"
            for kind, got in results:
                assert (kind, got) == ("ok", NEW_TOKENS) or (
                    "message bus was interrupted" in str(got) or "went away" in str(got)
                ), results
            assert wait_until(lambda: generate(mesh.url, 99) == ("ok", NEW_TOKENS), 10,
                              "a request served after the node died") < 10
            info = httpx.get(mesh.url + "/server_info", timeout=10).json()
            assert len(info["engines"]) == 1
        survivors = ",".join(node.url for node in nodes[1:])
        assert asyncio.run(get_page(survivors)) == PAGE
