"""cachectl: the host segments (domain, no sockets), LocalCachectl, the gRPC service in
process through CachectlClient, the real process, and `radixmesh up`'s wiring."""

from __future__ import annotations

import asyncio
import errno
import math
import os
import queue
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from process_helpers import service_process

from radixmesh.core.flags import parse_config, shared_values, to_flags
from radixmesh.core.hicache import HostPoolSpec, KVGeometry, shm_root
from radixmesh.core.service_settings import CachectlConfig
from radixmesh.engine.stores import host_pool
from radixmesh.engine.stores.host_pool import (
    SEGMENT_PREFIX,
    HostSegments,
    LocalCachectl,
    NoSegment,
    escaped_engine_id,
)
from radixmesh.launcher import SERVICE_CONFIGS, Mesh, MeshArgs
from radixmesh.mesh.nats_server import free_port
from radixmesh.services.cachectl.server import SERVICE_NAME, CachectlService
from radixmesh.services.scheduler.cachectl_client import (
    CachectlClient,
    CachectlUnavailable,
    HostTierStats,
)

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=3, head_dim=4, dtype="bfloat16", page_size=4)
SLOTS = 32
_LISTENING = re.compile(r"cachectl: gRPC on (\S+):(\d+), /metrics on (\S+):(\d+)")


def segment_files(shm_dir: Path) -> list[str]:
    return sorted(p.name for p in shm_dir.iterdir() if p.name.startswith(SEGMENT_PREFIX))


def stale_name(engine_id: str) -> str:
    return f"{SEGMENT_PREFIX}{escaped_engine_id(engine_id)}-{os.urandom(8).hex()}"


# ---- the domain -------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_open_creates_a_segment_file_of_the_pools_bytes(tmp_path, layout):
    segments = HostSegments(tmp_path)
    spec = segments.open("e0", GEOMETRY, SLOTS, layout)
    assert spec.nbytes == SLOTS * 2 * 2 * 3 * 4 * 2
    assert math.prod(spec.shape()) * 2 == spec.nbytes
    assert (spec.num_slots, spec.layout, spec.geometry) == (SLOTS, layout, GEOMETRY)
    assert Path(spec.path) == tmp_path / spec.name
    assert re.fullmatch(SEGMENT_PREFIX + r"e0-[0-9a-f]{16}", spec.name)
    assert os.stat(spec.path).st_size == spec.nbytes
    assert segments.stats("e0") == (SLOTS, 0, spec.nbytes, 0)
    assert segments.engines() == ["e0"]
    segments.close()


def test_a_second_open_replaces_the_engines_segment(tmp_path):
    segments = HostSegments(tmp_path)
    first = segments.open("e0", GEOMETRY, SLOTS, "layer_first")
    segments.record("e0", [1, 2])
    second = segments.open("e0", GEOMETRY, 2 * SLOTS, "page_first")
    assert first.path != second.path
    assert not os.path.exists(first.path)
    assert segment_files(tmp_path) == [second.name]
    assert segments.stats("e0") == (2 * SLOTS, 0, second.nbytes, 0)
    segments.close()


def test_open_unlinks_the_engines_stale_segments_and_nothing_else(tmp_path):
    stale = [stale_name("e0"), stale_name("e0")]
    kept = [stale_name("e1"), stale_name("e0-x"), stale_name("e"), "unrelated", "radixmesh-x"]
    for name in stale + kept:
        (tmp_path / name).write_bytes(b"kv")
    segments = HostSegments(tmp_path)
    spec = segments.open("e0", GEOMETRY, SLOTS, "layer_first")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, spec.name])
    segments.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


@pytest.mark.parametrize("engine_id", ["e/0", "a-b", "e 0", "ü", "_2f"])
def test_engine_ids_are_escaped_into_distinct_names_without_dashes(engine_id):
    escaped = escaped_engine_id(engine_id)
    assert re.fullmatch(r"[A-Za-z0-9._]+", escaped)
    others = {"e/0", "a-b", "e 0", "ü", "_2f", "e_0", "ab", "e0"} - {engine_id}
    assert escaped not in {escaped_engine_id(o) for o in others}


def test_record_and_forget_count_slots_in_use_and_repeats(tmp_path):
    segments = HostSegments(tmp_path)
    segments.open("e0", GEOMETRY, SLOTS, "layer_first")
    assert segments.record("e0", [0, 1, 2]) == 0
    assert segments.stats("e0").used_slots == 3
    assert segments.record("e0", [2, 3, 3]) == 2  # 2 held already, 3 twice
    assert segments.stats("e0").used_slots == 4
    assert segments.forget("e0", [0, 0, 9]) == 2  # 0 twice, 9 never held
    assert segments.stats("e0").used_slots == 3
    assert segments.record("e0", []) == 0
    assert segments.stats("e0").repeated == 4
    assert segments.forget("e0", [1, 2, 3]) == 0
    assert segments.stats("e0").used_slots == 0
    segments.close()


def test_slots_outside_the_pool_are_refused_and_change_nothing(tmp_path):
    segments = HostSegments(tmp_path)
    segments.open("e0", GEOMETRY, SLOTS, "layer_first")
    for bad in ([0, SLOTS], [-1, 1]):
        with pytest.raises(ValueError, match="outside its host pool"):
            segments.record("e0", bad)
    assert segments.stats("e0").used_slots == 0
    segments.close()


@pytest.mark.parametrize(
    ("engine_id", "geometry", "num_slots", "layout", "match"),
    [
        ("", GEOMETRY, SLOTS, "layer_first", "engine_id"),
        ("e0", KVGeometry(0, 3, 4, "bfloat16", 4), SLOTS, "layer_first", "num_layers=0"),
        ("e0", KVGeometry(2, 3, 4, "int8", 4), SLOTS, "layer_first", "dtype"),
        ("e0", GEOMETRY, SLOTS, "token_first", "layout"),
        ("e0", GEOMETRY, SLOTS + 1, "layer_first", "multiple of the page size"),
        ("e0", GEOMETRY, 0, "layer_first", "multiple of the page size"),
        ("e" * 200, GEOMETRY, SLOTS, "layer_first", "too long"),
    ],
)
def test_a_pool_that_cannot_be_is_refused(tmp_path, engine_id, geometry, num_slots, layout,
                                          match):
    with pytest.raises(ValueError, match=match):
        HostSegments(tmp_path).open(engine_id, geometry, num_slots, layout)
    assert segment_files(tmp_path) == []


def test_a_segment_larger_than_the_free_room_is_refused(tmp_path, monkeypatch):
    class Full:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(host_pool.os, "statvfs", lambda _: Full())
    with pytest.raises(OSError, match="does not fit") as caught:
        HostSegments(tmp_path).open("e0", GEOMETRY, SLOTS * 1024, "layer_first")
    assert caught.value.errno == errno.ENOSPC
    assert segment_files(tmp_path) == []


def test_an_engine_without_a_segment_has_no_stats(tmp_path):
    segments = HostSegments(tmp_path)
    with pytest.raises(NoSegment):
        segments.record("e0", [0])
    with pytest.raises(NoSegment):
        segments.stats("e0")


def test_close_unlinks_every_segment(tmp_path):
    segments = HostSegments(tmp_path)
    segments.open("e0", GEOMETRY, SLOTS, "layer_first")
    segments.open("e1", GEOMETRY, SLOTS, "page_first")
    assert len(segment_files(tmp_path)) == 2
    assert segments.total_bytes == 2 * SLOTS * GEOMETRY.token_bytes
    segments.close()
    assert segment_files(tmp_path) == []
    assert segments.engines() == []
    segments.close()


# ---- LocalCachectl ------------------------------------------------------------------------


def test_local_cachectl_is_the_domain_in_process(tmp_path):
    async def run() -> None:
        local = LocalCachectl(tmp_path)
        with pytest.raises(RuntimeError, match="not open"):
            await local.record([0])
        spec = await local.open("e0", GEOMETRY, SLOTS, "page_first")
        assert isinstance(spec, HostPoolSpec)
        assert os.stat(spec.path).st_size == spec.nbytes
        await local.record([0, 1, 2, 2])
        await local.forget([1])
        assert local.stats() == (SLOTS, 2, spec.nbytes, 1)
        with pytest.raises(ValueError):
            await local.record([SLOTS])
        again = await local.open("e1", GEOMETRY, SLOTS, "layer_first")
        assert segment_files(tmp_path) == [again.name]
        await local.close()
        assert segment_files(tmp_path) == []

    asyncio.run(run())


# ---- the service over gRPC, in process ---------------------------------------------------


def test_service_over_grpc_through_the_client(tmp_path):
    async def run() -> None:
        config = CachectlConfig(port=0, metrics_port=0, shm_dir=str(tmp_path))
        service = CachectlService(config)
        await service.start()
        addr = f"127.0.0.1:{service.port}"
        client = CachectlClient(addr)
        try:
            async with grpc.aio.insecure_channel(addr) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                for name in ("", SERVICE_NAME):
                    reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING

            with pytest.raises(RuntimeError, match="not open"):
                await client.record([0])
            spec = await client.open("e0", GEOMETRY, SLOTS, "page_first")
            assert spec == service.segments.spec("e0")
            assert os.stat(spec.path).st_size == spec.nbytes
            await client.record([0, 1, 2, 3])
            await client.record([3])
            await client.forget([0])
            assert await client.stats() == HostTierStats(SLOTS, 3, spec.nbytes, 1)
            with pytest.raises(ValueError, match="outside its host pool"):
                await client.forget([SLOTS])
            with pytest.raises(ValueError, match="layout"):
                await client.open("e0", GEOMETRY, SLOTS, "token_first")

            again = await client.open("e0", GEOMETRY, 2 * SLOTS, "layer_first")
            assert not os.path.exists(spec.path)
            assert (await client.stats()).used_slots == 0
            assert segment_files(tmp_path) == [again.name]

            # cachectl restarted: it holds no segment of the engine any more.
            service.segments.drop("e0")
            with pytest.raises(CachectlUnavailable, match="FAILED_PRECONDITION"):
                await client.record([0])
            await client.open("e0", GEOMETRY, SLOTS, "layer_first")
        finally:
            await service.stop()
        assert segment_files(tmp_path) == []
        started = time.monotonic()
        with pytest.raises(CachectlUnavailable, match="UNAVAILABLE"):
            await client.record([0])
        assert time.monotonic() - started < client.timeout
        await client.close()

    asyncio.run(run())


def test_a_segment_cachectl_cannot_create_leaves_the_tier_unavailable(tmp_path, monkeypatch):
    class Full:
        f_bavail, f_frsize = 0, 4096

    async def run() -> None:
        service = CachectlService(CachectlConfig(port=0, metrics_port=0, shm_dir=str(tmp_path)))
        await service.start()
        client = CachectlClient(f"127.0.0.1:{service.port}")
        try:
            await client.open("e0", GEOMETRY, SLOTS, "layer_first")
            monkeypatch.setattr(host_pool.os, "statvfs", lambda _: Full())
            with pytest.raises(CachectlUnavailable, match="RESOURCE_EXHAUSTED.*does not fit"):
                await client.open("e0", GEOMETRY, SLOTS, "layer_first")
            assert service.segments.engines() == []
        finally:
            await client.close()
            await service.stop()
        assert segment_files(tmp_path) == []

    asyncio.run(run())


def test_a_client_of_a_dead_address_raises_within_its_timeout():
    async def run() -> None:
        client = CachectlClient(f"127.0.0.1:{free_port()}", timeout=0.5)
        started = time.monotonic()
        with pytest.raises(CachectlUnavailable, match="cachectl at 127.0.0.1") as caught:
            await client.open("e0", GEOMETRY, SLOTS, "layer_first")
        assert time.monotonic() - started < 2.0
        assert isinstance(caught.value, ConnectionError)
        await client.close()

    asyncio.run(run())


# ---- the process ----------------------------------------------------------------------------


def test_the_process_serves_reports_and_cleans_up_on_sigterm(tmp_path):
    metrics_port = free_port()
    module = "radixmesh.services.cachectl"
    flags = ("--port=0", f"--metrics-port={metrics_port}", f"--shm-dir={tmp_path}")
    with service_process(module, *flags) as proc:
        lines: queue.Queue[str | None] = queue.Queue()
        log: list[str] = []

        def read() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                log.append(line)
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        match = None
        while match is None:
            line = lines.get(timeout=60)
            assert line is not None, "cachectl exited at start:\n" + "".join(log)
            match = _LISTENING.search(line)
        assert int(match[4]) == metrics_port
        base = f"http://127.0.0.1:{metrics_port}"
        with urllib.request.urlopen(base + "/health", timeout=5) as resp:
            assert resp.status == 200

        async def use() -> HostPoolSpec:
            client = CachectlClient(f"{match[1]}:{match[2]}")
            spec = await client.open("e0", GEOMETRY, SLOTS, "layer_first")
            await client.record([4, 5, 6])
            await client.close()
            return spec

        spec = asyncio.run(use())
        assert os.path.exists(spec.path)
        with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert f'radixmesh:hicache_host_slots{{engine_id="e0"}} {SLOTS}.0' in text
        assert 'radixmesh:hicache_host_used_slots{engine_id="e0"} 3.0' in text
        assert f"radixmesh:hicache_host_bytes {float(spec.nbytes)}" in text

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, "".join(log)
        assert segment_files(tmp_path) == []
        assert sum("cachectl starting with config" in line for line in log) == 1


# ---- radixmesh up ---------------------------------------------------------------------------


@pytest.mark.parametrize("hierarchical", [False, True])
def test_up_starts_a_cachectl_per_engine_before_its_scheduler(monkeypatch, hierarchical):
    mesh = Mesh(MeshArgs(dp_size=2, enable_hierarchical_cache=hierarchical, port=0,
                         grpc_port=0))
    mesh._pick_front_ports()
    spawned: list[tuple[str, str, dict]] = []
    monkeypatch.setattr(mesh, "_spawn", lambda name, service, own, **_: spawned.append(
        (name, service, own)))
    for e in range(2):
        mesh._start_engine(e, "null", 2)
    names = [name for name, _, _ in spawned]
    if not hierarchical:
        assert not any(service == "cachectl" for _, service, _ in spawned)
        assert all("cachectl_addr" not in own for _, _, own in spawned)
        return
    for e in range(2):
        assert names.index(f"cachectl-{e}") < names.index(f"worker-{e}.0")
        cachectl = spawned[names.index(f"cachectl-{e}")][2]
        scheduler = spawned[names.index(f"scheduler-{e}")][2]
        assert scheduler["cachectl_addr"] == f"127.0.0.1:{cachectl['port']}"
        values = {**shared_values(mesh.args, SERVICE_CONFIGS["cachectl"]), **cachectl}
        config = parse_config(CachectlConfig, to_flags(CachectlConfig, values))
        assert config.port == cachectl["port"]
        # This mesh's own directory, named by its HTTP port: another mesh's e0 is elsewhere.
        assert config.shm_dir == f"{shm_root()}/radixmesh-{mesh._front_ports[0][0]}"
