"""The host KV tier through `radixmesh up` on the real model (float32): cachectl owns the
shared memory, the workers copy into it, /generate reports the tiers; a tensor-parallel
engine gives the same tokens; and cachectl's death costs no request."""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from process_helpers import running_mesh

from radixmesh.api import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 8}


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 30000) for _ in range(length)] for _ in range(n)]


def generate(url: str, ids: list[int]) -> dict:
    reply = httpx.post(
        url + "/generate", json={"input_ids": ids, "sampling_params": GREEDY}, timeout=300
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def engine_info(url: str) -> dict:
    return httpx.get(url + "/server_info").json()["internal_states"][0]


def scrape(mesh, service: str, name: str) -> float | None:
    child = next(c for c in mesh.children if c.name == service)
    text = httpx.get(child.health_url.removesuffix("/health") + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_a_conversation_pushed_out_of_the_device_comes_back_from_cachectl(tmp_path):
    first, *others = prompts(8, 1000, seed=1)
    with running_mesh(
        tmp_path, dtype="float32", max_total_tokens=2048, enable_hierarchical_cache=True,
        hicache_ratio=8,
    ) as mesh:
        answer = generate(mesh.url, first)
        for ids in others:  # the 2048-slot device pool holds two of these at most
            generate(mesh.url, ids)
        again = generate(mesh.url, first)
        details = again["meta_info"]["cached_tokens_details"]
        assert details["host"] >= 900 and details["storage"] == 0
        assert again["meta_info"]["cached_tokens"] == details["device"] + details["host"]
        assert again["output_ids"] == answer["output_ids"]
        info = engine_info(mesh.url)
        assert info["host_slots"] == 8 * 2048 and info["host_load_tokens"] == details["host"]
        # cachectl holds what the scheduler holds: every slot recorded, none leaked.
        wait_for(lambda: scrape(mesh, "cachectl-0", "radixmesh:hicache_host_used_slots")
                 == info["host_cached_tokens"])
        assert scrape(mesh, "scheduler-0", "radixmesh:hicache_host_tier_up") == 1
        assert httpx.post(mesh.url + "/flush_cache").status_code == 200
        flushed = engine_info(mesh.url)
        assert flushed["cached_tokens"] == flushed["host_cached_tokens"] == 0
        wait_for(lambda: scrape(mesh, "cachectl-0", "radixmesh:hicache_host_used_slots") == 0)


def test_losing_cachectl_fails_no_request_and_its_return_brings_the_tier_back(tmp_path):
    ids = prompts(12, 600, seed=2)
    with running_mesh(
        tmp_path, dtype="float32", max_total_tokens=1024, enable_hierarchical_cache=True,
        hicache_ratio=8,
    ) as mesh:
        expected = [generate(mesh.url, p)["output_ids"] for p in ids[:4]]
        cachectl = next(c for c in mesh.children if c.name == "cachectl-0")
        with ThreadPoolExecutor(4) as pool:
            running = [pool.submit(generate, mesh.url, p) for p in ids[:4]]
            os.kill(cachectl.proc.pid, signal.SIGKILL)
            replies = [r.result() for r in running]
        assert [r["output_ids"] for r in replies] == expected
        # The supervisor starts it again; the scheduler opens a fresh host pool on it.
        assert mesh.supervisor is not None
        wait_for(lambda: mesh.supervisor.restarts()["cachectl-0"] == 1)
        wait_for(lambda: scrape(mesh, "scheduler-0", "radixmesh:hicache_host_tier_lost_total")
                 == 1)
        wait_for(lambda: scrape(mesh, "scheduler-0", "radixmesh:hicache_host_tier_up") == 1)
        answer = generate(mesh.url, ids[8])
        for p in ids[9:]:
            generate(mesh.url, p)
        again = generate(mesh.url, ids[8])
        assert again["meta_info"]["cached_tokens_details"]["host"] >= 500
        assert again["output_ids"] == answer["output_ids"]


def test_tensor_parallel_ranks_copy_their_heads_and_give_tp1_tokens(tmp_path):
    first, *others = prompts(4, 500, seed=3)
    with Engine(dtype="float32", max_total_tokens=4096, show_progress=False) as engine:
        expected = engine.generate(input_ids=first, sampling_params=GREEDY)["output_ids"]
    with running_mesh(
        tmp_path, tp_size=3, dtype="float32", max_total_tokens=1024,
        enable_hierarchical_cache=True, hicache_ratio=8,
    ) as mesh:
        assert generate(mesh.url, first)["output_ids"] == expected
        for ids in others:
            generate(mesh.url, ids)
        again = generate(mesh.url, first)
        assert again["meta_info"]["cached_tokens_details"]["host"] >= 450
        assert again["output_ids"] == expected
