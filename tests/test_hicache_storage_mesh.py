"""The storage (L3) KV tier through `radixmesh up` on the real model (float32, greedy).

Pages written behind the host tier come back as a storage hit, with the same tokens: after
/flush_cache (file backend), on the other engine of a two-engine mesh sharing the backend
(the mesh's NATS object store; a Redis of our own) and after the mesh restarts (file). A
corrupt page or a dead backend costs a recompute, never a wrong token or a failed request;
bad storage settings make `radixmesh up` exit 2."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from process_helpers import redis_server, running_mesh

from radixmesh.core.gguf import read_gguf
from radixmesh.core.hicache import KVGeometry, PageKeys
from radixmesh.core.model_files import model_fingerprint, resolve_model_path
from radixmesh.engine.model.weights_gguf import config_from_gguf
from radixmesh.launcher import Mesh

GREEDY = {"temperature": 0, "max_new_tokens": 8}
PAGE = 64  # hicache_storage_page_size's default
HEADER_BYTES = 24  # RMKV, version, reserved, payload length, CRC-32, reserved
# A small device pool keeps each engine's host segment (twice as many slots) at 0.4 GB.
HICACHE = {"dtype": "float32", "max_total_tokens": 4096, "enable_hierarchical_cache": True}
# The tokenizer's cache-aware routing off (no prompt is ever cached enough to outweigh load),
# so a prompt one engine has cached goes to the other, idler and emptier one: the way a user
# of `radixmesh up` spreads requests evenly, by the tokenizer's RADIXMESH_CACHE_THRESHOLD.
ROUTE_BY_LOAD = {"RADIXMESH_CACHE_THRESHOLD": "2"}


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(length)]


def generate(url: str, ids: list[int], **fields: object) -> dict:
    body = {"input_ids": ids, "sampling_params": GREEDY, **fields}
    reply = httpx.post(url + "/generate", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def tiers(answer: dict) -> dict[str, int]:
    """The answer's cached tokens by tier, checked to add up to its cached_tokens."""
    meta = answer["meta_info"]
    details = meta["cached_tokens_details"]
    assert set(details) == {"device", "host", "storage"}
    assert meta["cached_tokens"] == sum(details.values())
    return details


def same_output(answer: dict, expected: dict) -> None:
    assert answer["output_ids"] == expected["output_ids"]
    assert answer["text"] == expected["text"]


def flush(url: str) -> None:
    reply = httpx.post(url + "/flush_cache", timeout=30)
    assert reply.status_code == 200, reply.text
    assert "flushed" in reply.text


_SAMPLE = re.compile(r"^([^\s{]+)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric(mesh: Mesh, service: str, name: str, **labels: str) -> float:
    """The sum of the service's samples of `name` that carry `labels` (0 when none)."""
    child = next(c for c in mesh.children if c.name == service)
    text = httpx.get(child.health_url.removesuffix("/health") + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m[1] == name and labels.items() <= dict(_LABEL.findall(m[2] or "")).items():
            total += float(m[3])
    return total


def storage_pages(mesh: Mesh, outcome: str, engine: int | None = None) -> float:
    """cachectl's storage page count of `outcome`: one engine's, or every engine's."""
    names = [c.name for c in mesh.children if c.name.startswith("cachectl-")]
    if engine is not None:
        names = [f"cachectl-{engine}"]
    return sum(
        metric(mesh, n, "radixmesh:hicache_storage_pages_total", outcome=outcome) for n in names
    )


def prefetches(mesh: Mesh, engine: int, outcome: str) -> float:
    return metric(mesh, f"scheduler-{engine}", "radixmesh:hicache_prefetches_total",
                  outcome=outcome)


def wait_for(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def file_backend(path: Path) -> dict:
    return {"hicache_storage_backend": "file",
            "hicache_storage_backend_extra_config": json.dumps({"path": str(path)})}


def page_file(store: Path, key: str) -> Path:
    return store / key[:2] / key


class StoredPages:
    """Where the mesh's engines store a prompt's full pages (the bundled model in float32,
    no cache_salt): their keys, and the payload bytes of one page."""

    def __init__(self) -> None:
        path = resolve_model_path(None)
        c = config_from_gguf(read_gguf(path))
        geometry = KVGeometry(c.num_layers, c.num_kv_heads, c.head_dim, "float32")
        self._keys = PageKeys(model_fingerprint(path), geometry, PAGE)
        self.page_bytes = PAGE * geometry.token_bytes

    def keys(self, ids: list[int]) -> list[str]:
        return self._keys.keys(ids, None, len(ids) // PAGE)


@pytest.fixture(scope="module")
def pages() -> StoredPages:
    return StoredPages()


@pytest.fixture(scope="class")
def file_mesh(tmp_path_factory) -> Iterator[tuple[Mesh, Path]]:
    """One engine with the file backend, and the directory of its pages. The timeout
    policy with a deadline no stall of this machine reaches: a prefetch ends complete."""
    root = tmp_path_factory.mktemp("file-mesh")
    store = root / "kv"
    with running_mesh(
        root / "logs", **HICACHE, **file_backend(store), hicache_storage_prefetch_timeout=60
    ) as mesh:
        yield mesh, store


class TestFileBackend:
    """One mesh for both: prompts of their own, counters read as differences."""

    def test_a_flushed_prompt_comes_back_from_file_storage(self, file_mesh, pages):
        mesh, store = file_mesh
        ids = prompt(1000, seed=11)
        first = generate(mesh.url, ids)
        assert tiers(first)["storage"] == 0
        # Written a step or two after the request, by cachectl on its own: one file per full
        # page, at <path>/<key[:2]>/<key>, framed by its header.
        keys = pages.keys(ids)
        assert len(keys) == 15
        wait_for(lambda: all(page_file(store, k).is_file() for k in keys))
        for key in keys:
            blob = page_file(store, key).read_bytes()
            assert blob[:5] == b"RMKV\x01" and blob[5:8] == bytes(3)
            assert int.from_bytes(blob[8:16], "little") == len(blob) - HEADER_BYTES
            assert len(blob) - HEADER_BYTES == pages.page_bytes
            assert int.from_bytes(blob[16:20], "little") == zlib.crc32(blob[HEADER_BYTES:])
        wait_for(lambda: storage_pages(mesh, "written") >= len(keys))
        complete = prefetches(mesh, 0, "complete")
        fetched = metric(mesh, "scheduler-0", "radixmesh:hicache_prefetch_tokens_total")
        hits = storage_pages(mesh, "hit")

        flush(mesh.url)  # the device and host tiers; storage keeps its pages
        info = httpx.get(mesh.url + "/server_info").json()["internal_states"][0]
        assert info["cached_tokens"] == info["host_cached_tokens"] == 0
        assert all(page_file(store, k).is_file() for k in keys)
        again = generate(mesh.url, ids)
        got = tiers(again)
        assert got["storage"] >= 0.9 * len(ids) and got["device"] == got["host"] == 0
        assert got["storage"] == len(keys) * PAGE
        same_output(again, first)
        assert prefetches(mesh, 0, "complete") == complete + 1
        assert metric(mesh, "scheduler-0", "radixmesh:hicache_prefetch_tokens_total") == (
            fetched + got["storage"])
        assert storage_pages(mesh, "hit") == hits + len(keys)
        # Another tenant's cache_salt names other pages: nothing of this prompt's is its.
        flush(mesh.url)
        salted = generate(mesh.url, ids, cache_salt="another tenant")
        assert tiers(salted)["storage"] == 0
        same_output(salted, first)

    def test_a_corrupt_page_costs_a_recompute_from_it_on_not_a_wrong_token(
        self, file_mesh, pages
    ):
        mesh, store = file_mesh
        ids = prompt(1000, seed=12)
        first = generate(mesh.url, ids)
        keys = pages.keys(ids)
        wait_for(lambda: all(page_file(store, k).is_file() for k in keys))
        bad = 7  # a page in the middle: pages 0-6 still come from storage
        with open(page_file(store, keys[bad]), "r+b") as f:
            at = HEADER_BYTES + pages.page_bytes // 2
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0xFF]))
        corrupt = storage_pages(mesh, "corrupt")
        partial = prefetches(mesh, 0, "partial")

        flush(mesh.url)
        again = generate(mesh.url, ids)
        got = tiers(again)
        assert got["storage"] == bad * PAGE and got["device"] == got["host"] == 0
        same_output(again, first)
        assert storage_pages(mesh, "corrupt") == corrupt + 1
        assert prefetches(mesh, 0, "partial") == partial + 1


def test_pages_outlive_the_mesh_that_wrote_them(tmp_path):
    store = tmp_path / "kv"
    ids = prompt(1000, seed=13)
    with running_mesh(tmp_path / "first", **HICACHE, **file_backend(store)) as mesh:
        first = generate(mesh.url, ids)
        wait_for(lambda: storage_pages(mesh, "written") >= len(ids) // PAGE)
    with running_mesh(tmp_path / "second", **HICACHE, **file_backend(store)) as mesh:
        again = generate(mesh.url, ids)
        got = tiers(again)
        assert got["storage"] >= 0.9 * len(ids) and got["device"] == got["host"] == 0
        same_output(again, first)
        assert storage_pages(mesh, "hit") == len(ids) // PAGE
        assert storage_pages(mesh, "written") == 0


def served_by_the_other_engine(mesh: Mesh, ids: list[int]) -> None:
    """One engine computes the prompt and writes its pages; the other one (which has never
    seen it) answers it again from storage, with the same tokens."""
    wait_for(lambda: len(httpx.get(mesh.url + "/server_info").json()["internal_states"]) == 2)
    first = generate(mesh.url, ids)
    assert tiers(first)["storage"] == 0
    pages = len(ids) // PAGE
    wait_for(lambda: storage_pages(mesh, "written") >= pages)
    writer = next(e for e in (0, 1) if storage_pages(mesh, "written", e) >= pages)
    reader = 1 - writer

    again = generate(mesh.url, ids)  # routed by load: to the engine that has not got it
    got = tiers(again)
    assert got["storage"] >= 0.9 * len(ids) and got["device"] == got["host"] == 0
    same_output(again, first)
    assert storage_pages(mesh, "hit", reader) == pages
    assert storage_pages(mesh, "hit", writer) == 0
    assert prefetches(mesh, reader, "complete") == 1


def test_an_engine_answers_from_pages_another_engine_put_in_the_nats_object_store(tmp_path):
    with running_mesh(
        tmp_path, dp_size=2, **HICACHE, hicache_storage_backend="nats",
        hicache_storage_backend_extra_config=json.dumps({"bucket": "storage-mesh-test"}),
        hicache_storage_prefetch_policy="wait_complete", extra_env=ROUTE_BY_LOAD,
    ) as mesh:
        served_by_the_other_engine(mesh, prompt(1000, seed=14))


def test_engines_share_pages_through_redis_and_carry_on_when_it_dies(tmp_path):
    with redis_server(tmp_path) as (redis, url), running_mesh(
        tmp_path / "logs", dp_size=2, **HICACHE, hicache_storage_backend="redis",
        hicache_storage_backend_extra_config=json.dumps({"url": url}),
        hicache_storage_prefetch_timeout=60, extra_env=ROUTE_BY_LOAD,
    ) as mesh:
        served_by_the_other_engine(mesh, prompt(1000, seed=15))

        # Redis dies: storage reads and writes fail, no request does.
        ids = prompt(600, seed=16)
        expected = generate(mesh.url, ids)
        written = 1000 // PAGE + len(ids) // PAGE
        wait_for(lambda: storage_pages(mesh, "written") >= written)
        redis.kill()
        redis.wait()
        flush(mesh.url)
        read_errors = storage_pages(mesh, "read_error")
        again = generate(mesh.url, ids)
        assert tiers(again) == {"device": 0, "host": 0, "storage": 0}
        same_output(again, expected)
        assert storage_pages(mesh, "read_error") > read_errors
        fresh = generate(mesh.url, prompt(600, seed=17))  # pages no engine has written yet
        assert tiers(fresh)["storage"] == 0
        assert fresh["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
        wait_for(lambda: storage_pages(mesh, "write_error") >= 1)
        assert storage_pages(mesh, "written") == written


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--hicache-storage-backend", "s3"], "hicache_storage_backend"),
        (["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
          "{nope"], "hicache_storage_backend_extra_config"),
        (["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
          '{"bucket": "b"}'], "hicache_storage_backend_extra_config"),
        (["--hicache-storage-prefetch-policy", "sometimes"], "hicache_storage_prefetch_policy"),
    ],
    ids=["unknown-backend", "not-json", "foreign-key", "unknown-policy"],
)
def test_up_with_a_bad_storage_value_exits_2_naming_it(flags, named):
    done = subprocess.run(
        [sys.executable, "-m", "radixmesh.cli", "up", "--port", "0", "--grpc-port", "0",
         *flags],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], lines
    assert "starting" not in done.stdout
