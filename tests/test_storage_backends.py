"""cachectl's storage (L3) backends: the page framing, then each backend (files, a Redis of
our own, an embedded NATS with JetStream) round-tripping pages, catching corrupt ones, and
failing with OSError when its store is gone."""

from __future__ import annotations

import asyncio
import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import numpy as np
import pytest
import redis.asyncio
from nats.js.object_store import ObjectStore
from process_helpers import redis_server

from radixmesh.engine.stores import storage
from radixmesh.engine.stores.storage import (
    HEADER,
    REDIS_PREFIX,
    CorruptPage,
    FileBackend,
    NatsBackend,
    RedisBackend,
    StorageBackend,
    frame,
    open_backend,
    unframe,
)
from radixmesh.mesh.nats_server import EmbeddedNats, free_port

PAGE_BYTES = 3 << 20
BACKENDS = ["file", "redis", "nats"]


def new_key() -> str:
    return os.urandom(16).hex()


def new_page(nbytes: int = PAGE_BYTES) -> bytes:
    return os.urandom(nbytes)


def flipped(blob: bytes, at: int) -> bytes:
    out = bytearray(blob)
    out[at] ^= 0x01
    return bytes(out)


# ---- the framing ------------------------------------------------------------------------


def test_a_framed_page_unframes_to_a_view_of_its_payload():
    page = new_page(1000)
    blob = frame(page)
    assert len(blob) == HEADER.size + len(page) and HEADER.size % 8 == 0
    assert blob[:5] == b"RMKV\x01"
    payload = unframe(blob, "k")
    assert isinstance(payload, memoryview) and payload.obj is blob  # a view, not a copy
    assert payload == page
    assert unframe(frame(b""), "k") == b""


def test_frame_takes_any_contiguous_buffer():
    values = np.arange(1000, dtype=np.float32)
    assert bytes(unframe(frame(memoryview(values)), "k")) == values.tobytes()
    assert bytes(unframe(frame(memoryview(values.tobytes())[8:]), "k")) == values.tobytes()[8:]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: flipped(b, HEADER.size + 500), "checksum mismatch"),
        (lambda b: flipped(b, 16), "checksum mismatch"),  # the stored CRC itself
        (lambda b: b"XMKV" + b[4:], "bad magic"),
        (lambda b: b[:4] + b"\x02" + b[5:], "format version 2"),
        (lambda b: b[:-1], "the header says 1000"),
        (lambda b: b + b"\x00", "the header says 1000"),
        (lambda b: b[: HEADER.size - 1], "shorter than the 24-byte header"),
        (lambda b: b"", "0 bytes"),
    ],
    ids=["payload-bit", "crc-bit", "magic", "version", "truncated", "extended", "short", "empty"],
)
def test_unframe_rejects_a_damaged_page_naming_the_key(damage, message):
    blob = frame(new_page(1000))
    with pytest.raises(CorruptPage, match=f"page abc: .*{message}"):
        unframe(damage(blob), "abc")


# ---- the stores -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as (_, url):
        yield url


@pytest.fixture(scope="module")
def js_url() -> Iterator[str]:
    with EmbeddedNats(jetstream=True) as server:
        yield server.url


class Stored:
    """A backend under test, with raw access to the blobs it stores."""

    def __init__(self, backend: StorageBackend) -> None:
        self.backend = backend

    async def raw(self, key: str) -> bytes:
        raise NotImplementedError

    async def set_raw(self, key: str, blob: bytes) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        await self.backend.close()


class StoredFiles(Stored):
    backend: FileBackend

    async def raw(self, key: str) -> bytes:
        return self.backend.path_of(key).read_bytes()

    async def set_raw(self, key: str, blob: bytes) -> None:
        self.backend.path_of(key).write_bytes(blob)


class StoredInRedis(Stored):
    def __init__(self, backend: StorageBackend, url: str) -> None:
        super().__init__(backend)
        self.redis = redis.asyncio.from_url(url)

    async def raw(self, key: str) -> bytes:
        return await self.redis.get(REDIS_PREFIX + key)

    async def set_raw(self, key: str, blob: bytes) -> None:
        await self.redis.set(REDIS_PREFIX + key, blob)

    async def close(self) -> None:
        await self.redis.aclose()
        await super().close()


class StoredInNats(Stored):
    async def open_raw(self, url: str, bucket: str) -> None:
        self.nc = await nats.connect(url)
        self.objects = await self.nc.jetstream().object_store(bucket)

    async def raw(self, key: str) -> bytes:
        return (await self.objects.get(key)).data

    async def set_raw(self, key: str, blob: bytes) -> None:
        await self.objects.put(key, blob)

    async def close(self) -> None:
        await self.nc.close()
        await super().close()


@pytest.fixture(params=BACKENDS)
async def store(request, tmp_path) -> Stored:
    kind = request.param
    if kind == "file":
        stored = StoredFiles(await open_backend("file", {"path": str(tmp_path / "pages")}, ""))
    elif kind == "redis":
        url = request.getfixturevalue("redis_url")
        stored = StoredInRedis(await open_backend("redis", {"url": url}, ""), url)
    else:
        url = request.getfixturevalue("js_url")
        bucket = f"pages-{os.urandom(4).hex()}"  # a bucket of the test's own, created here
        stored = StoredInNats(await open_backend("nats", {"bucket": bucket}, url))
        await stored.open_raw(url, bucket)
    assert stored.backend.name == kind
    yield stored
    await stored.close()


@pytest.mark.anyio
async def test_pages_round_trip_bit_for_bit(store):
    backend = store.backend
    pages = {new_key(): new_page() for _ in range(4)}
    for key, page in pages.items():
        await backend.put(key, page)
    for key, page in pages.items():
        got = await backend.get(key)
        assert got is not None and bytes(got) == page
    keys = list(pages)
    absent = new_key()
    assert await backend.exists([keys[0], absent, keys[1], keys[2], absent, keys[3]]) == [
        True, False, True, True, False, True
    ]
    assert await backend.exists([]) == []
    assert await backend.get(absent) is None


@pytest.mark.anyio
async def test_a_second_put_replaces_the_page(store):
    key, first, second = new_key(), new_page(), new_page(PAGE_BYTES // 2)
    await store.backend.put(key, first)
    await store.backend.put(key, memoryview(second))
    assert bytes(await store.backend.get(key)) == second


@pytest.mark.anyio
async def test_concurrent_puts_and_gets_of_one_key_see_whole_pages(store):
    key = new_key()
    pages = [new_page(1 << 20) for _ in range(4)]
    await store.backend.put(key, pages[0])

    async def read() -> bytes | None:
        got = await store.backend.get(key)
        return None if got is None else bytes(got)

    results = await asyncio.gather(
        *(store.backend.put(key, page) for page in pages), *(read() for _ in range(8))
    )
    for got in results[len(pages):]:
        # A NATS get that meets a put's purge of the chunks it was reading is a miss.
        assert got in pages or (got is None and store.backend.name == "nats")
    assert bytes(await store.backend.get(key)) in pages


@pytest.mark.anyio
async def test_a_page_with_a_flipped_bit_or_cut_short_is_corrupt(store):
    key, page = new_key(), new_page()
    await store.backend.put(key, page)
    blob = await store.raw(key)
    assert len(blob) == HEADER.size + len(page) and blob[HEADER.size:] == page

    await store.set_raw(key, flipped(blob, HEADER.size + len(page) // 2))
    with pytest.raises(CorruptPage, match=f"page {key}: checksum mismatch"):
        await store.backend.get(key)
    await store.set_raw(key, blob[: len(blob) // 2])
    with pytest.raises(CorruptPage, match=f"page {key}: .* payload bytes, the header says"):
        await store.backend.get(key)
    await store.set_raw(key, b"not a page")
    with pytest.raises(CorruptPage, match=f"page {key}: 10 bytes, shorter"):
        await store.backend.get(key)
    await store.backend.put(key, page)  # a put heals it
    assert bytes(await store.backend.get(key)) == page


@pytest.mark.anyio
@pytest.mark.parametrize("key", ["../../etc/passwd", "ab", "A" * 32, "0" * 33])
async def test_a_key_must_be_32_hex_digits(store, key):
    with pytest.raises(ValueError, match="not 32 lowercase hex digits"):
        await store.backend.get(key)
    with pytest.raises(ValueError):
        await store.backend.put(key, b"x")
    with pytest.raises(ValueError):
        await store.backend.exists([new_key(), key])


# ---- NATS -------------------------------------------------------------------------------


@pytest.fixture
async def nats_store(js_url) -> StoredInNats:
    backend = NatsBackend(js_url, f"pages-{os.urandom(4).hex()}")
    await backend.connect()
    stored = StoredInNats(backend)
    await stored.open_raw(js_url, backend.bucket)
    yield stored
    await stored.close()


@pytest.mark.anyio
async def test_a_nats_page_replaced_while_it_is_read_is_a_miss(nats_store, monkeypatch):
    key, old, new = new_key(), new_page(), new_page()
    await nats_store.backend.put(key, old)
    get_info = ObjectStore.get_info
    replaced: list[str] = []

    async def get_info_then_replace(self, name, *args, **kwargs):
        info = await get_info(self, name, *args, **kwargs)
        if not replaced:
            replaced.append(name)
            # A put by any client, in the object store's own 128 KiB chunks.
            await nats_store.set_raw(key, frame(new))
        return info

    monkeypatch.setattr(ObjectStore, "get_info", get_info_then_replace)
    assert await nats_store.backend.get(key) is None  # the old page's chunks are purged
    assert replaced == [key]
    monkeypatch.undo()
    assert bytes(await nats_store.backend.get(key)) == new


@pytest.mark.anyio
async def test_a_nats_page_whose_chunks_are_gone_is_corrupt(nats_store):
    key = new_key()
    await nats_store.backend.put(key, new_page())
    bucket = nats_store.backend.bucket
    nuid = (await nats_store.objects.get_info(key)).nuid
    await nats_store.nc.jetstream().purge_stream(f"OBJ_{bucket}", subject=f"$O.{bucket}.C.{nuid}")
    assert await nats_store.backend.exists([key]) == [True]
    with pytest.raises(CorruptPage, match=f"page {key}: chunk 0 is missing"):
        await nats_store.backend.get(key)


# ---- files ------------------------------------------------------------------------------


def temporaries(root: Path) -> list[Path]:
    return sorted(root.rglob("*.tmp"))


@pytest.mark.anyio
async def test_files_sit_under_their_keys_first_two_digits_with_no_temporary_left(tmp_path):
    backend = FileBackend(tmp_path / "a" / "b")
    keys = [new_key() for _ in range(3)]
    for key in keys:
        await backend.put(key, new_page(1000))
        await backend.put(key, new_page(2000))
    files = sorted(p for p in (tmp_path / "a" / "b").rglob("*") if p.is_file())
    assert files == sorted(tmp_path / "a" / "b" / key[:2] / key for key in keys)
    assert temporaries(tmp_path) == []


class FullDisk:
    """A file that takes a few bytes, then fails as a full disk does."""

    def __init__(self, file) -> None:
        self.file = file

    def __enter__(self) -> FullDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()

    def write(self, data) -> int:
        self.file.write(bytes(memoryview(data)[:10]))
        self.file.flush()
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.anyio
async def test_a_put_onto_a_full_disk_fails_and_leaves_the_old_page(tmp_path, monkeypatch):
    backend = FileBackend(tmp_path)
    key, old = new_key(), new_page()
    await backend.put(key, old)
    opened: list[Path] = []

    def full_open(path, mode="r", *args, **kwargs):
        opened.append(Path(path))
        return FullDisk(open(path, mode, *args, **kwargs))

    # storage.open shadows the builtin for the module's own calls only.
    monkeypatch.setattr(storage, "open", full_open, raising=False)
    with pytest.raises(OSError) as failure:
        await backend.put(key, new_page())
    assert failure.value.errno == errno.ENOSPC
    assert len(opened) == 1 and opened[0].parent == backend.path_of(key).parent
    assert opened[0].name.startswith(f".{key}.") and opened[0].name.endswith(".tmp")
    assert not opened[0].exists() and temporaries(tmp_path) == []
    monkeypatch.undo()
    assert bytes(await backend.get(key)) == old


def test_opening_removes_temporaries_left_by_crashed_writers_only(tmp_path):
    folder = tmp_path / "ab"
    folder.mkdir()
    stale, fresh = folder / f".ab{'0' * 30}.1.tmp", folder / f".ab{'1' * 30}.2.tmp"
    stale.write_bytes(b"torn")
    fresh.write_bytes(b"being written")
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))
    FileBackend(tmp_path)
    assert temporaries(tmp_path) == [fresh]


# ---- dead stores ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_redis_that_nobody_serves_fails_fast_with_oserror():
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    backend = RedisBackend(url, timeout=1.0)
    for call in (
        backend.connect(),
        backend.get(new_key()),
        backend.put(new_key(), new_page(1000)),
        backend.exists([new_key()]),
    ):
        start = time.monotonic()
        with pytest.raises(ConnectionError) as failure:
            await call
        assert time.monotonic() - start < 1.0
        assert "redis at redis://127.0.0.1:" in str(failure.value)
        assert "hunter2" not in str(failure.value)
    await backend.close()


@pytest.mark.anyio
async def test_opening_nats_that_nobody_serves_fails_within_the_timeout():
    backend = NatsBackend(f"nats://127.0.0.1:{free_port()}", "pages", timeout=0.5)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="cannot reach NATS at nats://127.0.0.1:"):
        await backend.connect()
    assert time.monotonic() - start < 1.5
    with pytest.raises(ConnectionError, match="not connected"):
        await backend.get(new_key())


@pytest.mark.anyio
async def test_nats_operations_fail_with_oserror_once_the_server_is_gone():
    server = EmbeddedNats(jetstream=True).start()
    try:
        backend = NatsBackend(server.url, "pages", timeout=0.5)
        await backend.connect()
        key = new_key()
        await backend.put(key, new_page(1000))
    finally:
        server.stop()
    for call in (backend.get(key), backend.put(new_key(), new_page(1000)), backend.exists([key])):
        start = time.monotonic()
        with pytest.raises(OSError):
            await call
        assert time.monotonic() - start < 1.5
    await backend.close()
    with pytest.raises(ConnectionError, match="not connected"):
        await backend.put(key, b"x")


@pytest.mark.anyio
async def test_open_backend_wants_a_known_name_and_its_setting(tmp_path):
    with pytest.raises(ValueError, match="unknown storage backend 's3'"):
        await open_backend("s3", {}, "")
    for name in BACKENDS:
        with pytest.raises(ValueError, match=f"storage backend '{name}' needs"):
            await open_backend(name, {}, "nats://127.0.0.1:1")
    backend = await open_backend("file", {"path": tmp_path / "pages"}, "")
    assert isinstance(backend, FileBackend) and (tmp_path / "pages").is_dir()
