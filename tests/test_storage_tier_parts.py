"""The storage (L3) KV tier's parts, without an engine: page keys, host-only nodes from
storage in the radix tree, and PageMover moving pages between a host segment and a file
store."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from radixmesh.core.hicache import KVGeometry, PageKeys
from radixmesh.engine.kv_allocator import KVAllocator
from radixmesh.engine.radix_cache import RadixCache
from radixmesh.engine.stores.host_pool import HostSegments
from radixmesh.engine.stores.page_mover import PageMover
from radixmesh.engine.stores.storage import FileBackend

# ---- page keys ----------------------------------------------------------------------------

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")


def page_keys(
    fingerprint: str = "fingerprint", geometry: KVGeometry = GEOMETRY, page_tokens: int = 4
) -> PageKeys:
    return PageKeys(fingerprint, geometry, page_tokens)


def test_page_keys_chain_over_the_prefix():
    keys = page_keys()
    tokens = list(range(100, 124))  # 6 pages of 4
    base = keys.keys(tokens, None, 6)
    assert len(set(base)) == 6
    assert all(len(k) == 32 and k == k.lower() and int(k, 16) >= 0 for k in base)
    assert keys.keys(tokens, None, 3) == base[:3]  # a key names its whole prefix, no more
    assert keys.keys(tokens[:12], None, 3) == base[:3]  # what follows the pages is not in it
    for page in range(6):
        changed = list(tokens)
        changed[page * 4 + 2] += 1000  # one token of page `page`
        other = keys.keys(changed, None, 6)
        assert other[:page] == base[:page]  # the pages before it keep their keys
        assert all(a != b for a, b in zip(other[page:], base[page:], strict=True))
    # The same tokens in another place name another page: a key is a whole prefix.
    shifted = [0, 0, 0, 0, *tokens[:20]]
    assert set(keys.keys(shifted, None, 6)).isdisjoint(base)
    with pytest.raises(ValueError, match="no 7 pages"):
        keys.keys(tokens, None, 7)


def test_page_keys_differ_by_namespace_model_geometry_and_page_size():
    tokens = list(range(64))
    base = page_keys().keys(tokens, None, 2)
    variants = {
        "namespace": page_keys().keys(tokens, "tenant-a", 2),
        "another namespace": page_keys().keys(tokens, "tenant-b", 2),
        "empty namespace": page_keys().keys(tokens, "", 2),
        "model": page_keys("other-weights").keys(tokens, None, 2),
        "layers": page_keys(geometry=KVGeometry(3, 2, 16, "float32")).keys(tokens, None, 2),
        "kv heads": page_keys(geometry=KVGeometry(2, 4, 16, "float32")).keys(tokens, None, 2),
        "head_dim": page_keys(geometry=KVGeometry(2, 2, 32, "float32")).keys(tokens, None, 2),
        "dtype": page_keys(geometry=KVGeometry(2, 2, 16, "bfloat16")).keys(tokens, None, 2),
        "page size": page_keys(page_tokens=8).keys(tokens, None, 2),
    }
    for what, keys in variants.items():
        assert set(keys).isdisjoint(base), f"keys do not change with the {what}"
    assert len({tuple(k) for k in variants.values()}) == len(variants)
    # The stored form holds every layer and head whatever the device page size: replicas
    # paged differently share pages.
    paged = KVGeometry(2, 2, 16, "float32", page_size=4)
    assert page_keys(geometry=paged).keys(tokens, None, 2) == base


def test_page_keys_are_the_same_in_every_instance_and_process():
    tokens = list(range(8))
    first = page_keys()
    again = page_keys()
    assert first.keys(tokens, "tenant", 2) == again.keys(tokens, "tenant", 2)
    # Pinned: these name pages already in stores, across restarts and machines (no
    # per-process hash seed); a change of the format must change PageKeys.VERSION instead.
    assert first.keys(tokens, None, 2) == [
        "af3bce01df498f1b9ac4543702deb620",
        "9004824b746abfe442f4a253e7985a64",
    ]
    assert first.keys(tokens, "tenant", 1) == ["80fa18095db3f06bcf9715ad1092216d"]


# ---- the radix tree: host-only nodes read from storage ------------------------------------


def tree(page_size: int) -> tuple[RadixCache, KVAllocator]:
    cache = RadixCache(KVAllocator(256, page_size), page_size)
    host = KVAllocator(512, page_size)
    cache.attach_host(host)
    return cache, host


def check_tree(cache: RadixCache, host: KVAllocator) -> None:
    cache.check_invariants()
    assert cache.host_size() + host.available() == host.num_slots  # no host slot lost


@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_host_attaches_host_only_nodes_below_a_cached_prefix(page_size):
    cache, host = tree(page_size)
    tokens = list(range(1, 49))  # 48 tokens
    device = cache.allocator.alloc(16)
    assert cache.insert(tokens[:16], device) == 0

    slots = host.alloc(16)
    assert cache.insert_host(tokens[:32], 16, slots, None) == []  # takes all of them
    check_tree(cache, host)
    match = cache.match_prefix(tokens, count_hit=False)
    assert match.slots == device
    assert [s for n in match.host_nodes for s in n.host_slots] == slots
    assert match.host_len == 16 and match.host_nodes[0].depth == 16
    assert all(n.slots is None for n in match.host_nodes)
    assert cache.host_size() == 16

    # Pages 16..40 from storage: 16..32 are in the tree already; only 32..40 are taken.
    more = host.alloc(24)
    unused = cache.insert_host(tokens[:40], 16, more, None)
    assert unused == more[:16]
    host.free(unused)
    check_tree(cache, host)
    match = cache.match_prefix(tokens, count_hit=False)
    assert match.host_len == 24
    assert match.host_nodes[-1].depth == 32 and match.host_nodes[-1].host_slots == more[16:]

    # A prefix the tree does not hold (evicted meanwhile): nothing is taken.
    other = host.alloc(8)
    assert cache.insert_host([99] * 8 + tokens[:8], 8, other, None) == other
    elsewhere = host.alloc(8)
    assert cache.insert_host(tokens[:16], 8, elsewhere, "another namespace") == elsewhere
    # Everything there already: nothing taken either.
    again = host.alloc(16)
    assert cache.insert_host(tokens[:32], 16, again, None) == again
    with pytest.raises(ValueError, match="host slots"):
        cache.insert_host(tokens[:32], 16, again[:8], None)
    host.free(other + elsewhere + again)
    check_tree(cache, host)
    assert cache.match_prefix(tokens, count_hit=False).host_len == 24


@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_host_below_the_middle_of_an_edge_splits_it(page_size):
    cache, host = tree(page_size)
    tokens = list(range(1, 33))
    device = cache.allocator.alloc(24)
    cache.insert(tokens[:24], device)  # one edge of 24 tokens
    branch = tokens[:8] + [200 + i for i in range(16)]  # leaves it after 8 tokens
    slots = host.alloc(16)
    assert cache.insert_host(branch, 8, slots, None) == []
    check_tree(cache, host)
    match = cache.match_prefix(branch, count_hit=False)
    assert match.slots == device[:8] and match.host_len == 16
    assert match.host_nodes[0].depth == 8 and match.host_nodes[0].parent is match.node
    assert cache.match_prefix(tokens[:24], count_hit=False).slots == device  # untouched
    # The host-only node goes with its edge when the device prefix above it is evicted.
    freed = cache.evict(256)
    assert freed == 24
    check_tree(cache, host)
    assert cache.host_size() == 0 and host.available() == host.num_slots


# ---- PageMover: a host segment and a file store --------------------------------------------

PAGE_TOKENS = 8
SEGMENT_SLOTS = 64
NUMPY = {"float32": np.uint32, "bfloat16": np.uint16}  # the bits, as the worker copies them


def segment(spec) -> np.ndarray:
    """The segment file mapped as the worker maps it."""
    return np.memmap(spec.path, dtype=NUMPY[spec.geometry.dtype], mode="r+", shape=spec.shape())


def token_kv(pool: np.ndarray, spec, slot: int) -> np.ndarray:
    """One slot's K and V of every layer and head: [layers, 2, heads, head_dim]."""
    if spec.layout == "layer_first":
        return np.array(pool[:, :, slot])
    ps = spec.geometry.page_size
    return np.array(pool[slot // ps, :, :, slot % ps])


def page_of(pool: np.ndarray, spec, slots: list[int]) -> np.ndarray:
    """The stored form of a page: [layers, 2, tokens, heads, head_dim]."""
    return np.stack([token_kv(pool, spec, s) for s in slots], axis=2)


def fill(pool: np.ndarray, seed: int) -> None:
    rng = np.random.default_rng(seed)
    pool[...] = rng.integers(0, np.iinfo(pool.dtype).max, size=pool.shape, dtype=pool.dtype)
    pool.flush()


def new_key() -> str:
    return os.urandom(16).hex()


def source_pages(page_size: int) -> list[list[int]]:
    """Three pages of host slots in no order, in whole device pages."""
    if page_size == 1:
        return [[9, 3, 30, 31, 0, 17, 5, 6], list(range(40, 48)), list(range(63, 55, -1))]
    return [[12, 13, 14, 15, 0, 1, 2, 3], list(range(40, 48)), list(range(24, 32))]


@pytest.fixture
def shm(tmp_path) -> Path:
    """A tmp directory standing in for /dev/shm."""
    path = tmp_path / "shm"
    path.mkdir()
    return path


@pytest.mark.anyio
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
async def test_pages_round_trip_through_a_file_store_bit_exact(
    shm, tmp_path, layout, page_size, dtype
):
    store = FileBackend(tmp_path / "store")
    segments = HostSegments(shm, store)
    geometry = KVGeometry(2, 2, 4, dtype, page_size)
    try:
        spec = segments.open("e", geometry, SEGMENT_SLOTS, layout, PAGE_TOKENS)
        assert spec.storage == "file"
        pool = segment(spec)
        fill(pool, seed=1)
        mover = segments.mover("e")
        src = source_pages(page_size)
        keys = [new_key() for _ in src]
        expected = [page_of(pool, spec, slots) for slots in src]
        assert segments.store("e", list(zip(keys, src, strict=True))) == 3
        pool[...] = 0  # the slots may be reused once store() returns: the pages were copied
        await mover.flush(5)
        for key, page in zip(keys, expected, strict=True):
            stored = await store.get(key)
            assert bytes(stored) == page.tobytes()  # the layout-independent stored form

        assert await segments.query("e", keys) == 3
        dst = [s for slots in src[::-1] for s in slots]  # other slots than each page had
        arrived = [n async for n in segments.prefetch("e", keys, dst)]
        assert arrived == [1, 2, 3]
        for i, page in enumerate(expected):
            got = page_of(pool, spec, dst[i * PAGE_TOKENS : (i + 1) * PAGE_TOKENS])
            assert np.array_equal(got, page)
        del pool
    finally:
        segments.close()


@pytest.mark.anyio
async def test_a_page_stored_from_one_layout_reads_into_another(shm, tmp_path):
    segments = HostSegments(shm, FileBackend(tmp_path / "store"))
    try:
        a = segments.open("a", KVGeometry(2, 2, 4, "float32", 1), 32, "layer_first", 8)
        b = segments.open("b", KVGeometry(2, 2, 4, "float32", 4), 32, "page_first", 8)
        pool_a, pool_b = segment(a), segment(b)
        fill(pool_a, seed=2)
        fill(pool_b, seed=3)
        src = [[7, 1, 30, 2, 9, 10, 11, 0], list(range(16, 24))]
        keys = [new_key(), new_key()]
        expected = [page_of(pool_a, a, slots) for slots in src]
        assert segments.store("a", list(zip(keys, src, strict=True))) == 2
        await segments.mover("a").flush(5)
        dst = list(range(24, 32)) + list(range(4, 12))
        assert [n async for n in segments.prefetch("b", keys, dst)] == [1, 2]
        assert np.array_equal(page_of(pool_b, b, dst[:8]), expected[0])
        assert np.array_equal(page_of(pool_b, b, dst[8:]), expected[1])
        del pool_a, pool_b
    finally:
        segments.close()


@pytest.mark.anyio
async def test_query_and_prefetch_stop_at_the_first_missing_or_bad_page(shm, tmp_path):
    store = FileBackend(tmp_path / "store")
    segments = HostSegments(shm, store)
    try:
        spec = segments.open("e", KVGeometry(2, 2, 4, "float32"), SEGMENT_SLOTS, "layer_first",
                             PAGE_TOKENS)
        pool = segment(spec)
        fill(pool, seed=4)
        pages = [list(range(i * 8, i * 8 + 8)) for i in range(5)]
        keys = [new_key() for _ in pages]
        segments.store("e", [(keys[i], pages[i]) for i in (0, 1, 2, 4)])  # no page 3
        await segments.mover("e").flush(5)
        assert await segments.query("e", keys) == 3  # leading hits; page 4 does not count
        assert await segments.query("e", keys[3:]) == 0
        assert await segments.query("e", [keys[4], keys[0]]) == 2
        assert await segments.query("e", []) == 0

        dst = list(range(24, 64))
        before = np.array(pool)
        assert [n async for n in segments.prefetch("e", keys, dst)] == [1, 2, 3]
        assert np.array_equal(page_of(pool, spec, dst[16:24]), page_of(pool, spec, pages[2]))
        assert np.array_equal(pool[:, :, dst[24:]], before[:, :, dst[24:]])  # untouched

        # A page that fails its checksum, and one of the wrong size, end it too.
        path = store.path_of(keys[1])
        blob = bytearray(path.read_bytes())
        blob[-1] ^= 1
        path.write_bytes(bytes(blob))
        assert [n async for n in segments.prefetch("e", keys[:3], dst[:24])] == [1]
        await store.put(keys[1], b"\0" * 64)
        assert [n async for n in segments.prefetch("e", keys[:3], dst[:24])] == [1]
        with pytest.raises(ValueError, match="slots"):
            await segments.prefetch("e", keys[:2], dst[:8]).__anext__()  # 8 slots, 2 pages
        del pool
    finally:
        segments.close()


class SlowStore:
    """A storage backend over a dict, whose puts wait for `gate`."""

    name = "file"

    def __init__(self) -> None:
        self.pages: dict[str, bytes] = {}
        self.gate = asyncio.Event()

    async def exists(self, keys):
        return [k in self.pages for k in keys]

    async def get(self, key):
        return self.pages.get(key)

    async def put(self, key, data):
        await self.gate.wait()
        self.pages[key] = bytes(data)

    async def close(self):
        pass


@pytest.mark.anyio
async def test_a_full_write_queue_drops_pages(shm):
    segments = HostSegments(shm)  # the mover below is the segment's storage tier
    spec = segments.open("e", KVGeometry(2, 2, 4, "float32"), SEGMENT_SLOTS, "layer_first")
    store = SlowStore()
    page_bytes = PAGE_TOKENS * spec.geometry.token_bytes
    mover = PageMover(
        engine_id="e", spec=spec, backend=store, page_tokens=PAGE_TOKENS,
        queue_bytes=int(2.5 * page_bytes),
    )
    try:
        pages = [(new_key(), list(range(i * 8, i * 8 + 8))) for i in range(5)]
        assert mover.store(pages) == 2  # room for two pages: the rest are dropped
        assert mover.store(pages[2:]) == 0  # still full: the writer waits on the store
        store.gate.set()
        await mover.flush(5)
        assert set(store.pages) == {pages[0][0], pages[1][0]}
        assert mover.store(pages[2:]) == 2  # written out: room again
        await mover.flush(5)
        assert len(store.pages) == 4
        with pytest.raises(ValueError, match="slots"):
            mover.store([(new_key(), [0, 1, 2])])  # not a whole page
    finally:
        mover.close()
        segments.close()
