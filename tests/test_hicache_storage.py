"""The storage (L3) KV tier behind the host tier: page keys, host-only nodes from storage in
the radix tree, PageMover moving pages between a host segment and a file store, and the
in-process engine (a tiny random-weight model) prefetching from a slow or failing fake store
under each prefetch policy, with the same output as without any cache and no slot leaks."""

from __future__ import annotations

import asyncio
import errno
import json
import math
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tokenizers
from tiny_model import EOS, HEAD_DIM, KV_HEADS, LAYERS, VOCAB, save_tiny_model
from tokenizers import models, pre_tokenizers

import radixmesh.api as engine_module
from radixmesh import Engine
from radixmesh.core.hicache import KVGeometry, PageKeys
from radixmesh.core.model_files import model_fingerprint
from radixmesh.engine.kv_allocator import KVAllocator
from radixmesh.engine.radix_cache import RadixCache
from radixmesh.engine.scheduler import Scheduler
from radixmesh.engine.tiers import host_pool, page_mover
from radixmesh.engine.tiers.host_pool import HostSegments
from radixmesh.engine.tiers.page_mover import PREFETCH_AHEAD, PageMover
from radixmesh.engine.tiers.storage import CorruptPage, FileBackend

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


# ---- the engine: prefetch policies against a fake store -------------------------------------

PROMPT_TOKENS = 1000
STORAGE_PAGE = 64  # hicache_storage_page_size's default
PAGES = (PROMPT_TOKENS - 1) // STORAGE_PAGE  # all but the last prompt token can come from cache
GREEDY = {"max_new_tokens": 8, "temperature": 0}


def prompt() -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(EOS) for _ in range(PROMPT_TOKENS)]  # no EOS in it


PROMPT = prompt()
VARIANT = PROMPT[:900] + [7] * 100  # shares 14 storage pages (896 tokens) with PROMPT


class FakeStore:
    """A storage backend over a dict (shared between engines, as a real store is): a delay
    per get, and faults on demand."""

    name = "file"

    def __init__(self, pages: dict[str, bytes] | None = None, delay: float = 0.0) -> None:
        self.pages = {} if pages is None else pages
        self.delay = delay  # seconds each get takes
        self.slow: dict[str, float] = {}  # key -> how long its get takes instead
        self.faults: dict[str, type[Exception]] = {}  # key -> what its get raises
        self.down = False  # every call raises ConnectionError
        self.full = False  # every put raises OSError (no space)
        self.gets = 0
        self.puts = 0
        self.written: list[str] = []  # keys put, in order

    def _reach(self) -> None:
        if self.down:
            raise ConnectionError("the fake store is down")

    async def exists(self, keys):
        self._reach()
        return [k in self.pages for k in keys]

    async def get(self, key):
        self._reach()
        self.gets += 1
        await asyncio.sleep(self.slow.get(key, self.delay))
        if key in self.faults:
            raise self.faults[key](f"page {key}: fault injected")
        return self.pages.get(key)

    async def put(self, key, data):
        self._reach()
        self.puts += 1
        if self.full:
            raise OSError(errno.ENOSPC, "no space left on the fake store")
        self.pages[key] = bytes(data)
        self.written.append(key)

    async def close(self):
        pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny random-weight Llama, with room for a 1000-token prompt and a word-level
    tokenizer ("t0 t1 ..."), so that the Engine can load it."""
    path = save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (path / "config.json").write_text(json.dumps(config))
    tokenizer = tokenizers.Tokenizer(
        models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    return path


ENGINE = {"dtype": "float32", "max_total_tokens": 2048, "show_progress": False}


@pytest.fixture(scope="module")
def references(tiny) -> dict[str, list[int]]:
    """The outputs of PROMPT and VARIANT without any cache."""
    outputs = {}
    with Engine(str(tiny), **ENGINE) as engine:
        for name, ids in (("prompt", PROMPT), ("variant", VARIANT)):
            assert engine.flush_cache()
            out = engine.generate(input_ids=ids, sampling_params=GREEDY)
            assert out["meta_info"]["cached_tokens"] == 0
            outputs[name] = out["output_ids"]
    return outputs


@pytest.fixture(scope="module")
def reference(references) -> list[int]:
    """PROMPT's output without any cache."""
    return references["prompt"]


def expected_keys(tiny: Path, page_size: int = 1) -> list[str]:
    geometry = KVGeometry(LAYERS, KV_HEADS, HEAD_DIM, "float32", page_size)
    return PageKeys(model_fingerprint(tiny), geometry, STORAGE_PAGE).keys(PROMPT, None, PAGES)


def page_bytes() -> int:
    return LAYERS * 2 * STORAGE_PAGE * KV_HEADS * HEAD_DIM * 4


def storage_engine(
    tiny: Path, tmp_path: Path, store: FakeStore | Exception, **settings: Any
) -> Engine:
    """An in-process engine with a host tier whose storage tier is `store` (or whose
    storage cannot be reached: `store` is what connecting raises)."""

    async def open_fake(name, config, url):
        assert name == "file" and config == {"path": str(tmp_path / "store")}
        if isinstance(store, Exception):
            raise store
        return store

    # Through the module's global, as _storage_opener calls it when the host tier opens.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "open_backend", open_fake)
        engine = Engine(
            str(tiny),
            enable_hierarchical_cache=True,
            hicache_storage_backend="file",
            hicache_storage_backend_extra_config=json.dumps({"path": str(tmp_path / "store")}),
            **ENGINE,
            **settings,
        )
        try:
            # The host tier opens (and connects to storage) on the engine's loop, soon.
            wait_for(lambda: on_loop(engine, lambda s: s.host is not None), "no host tier")
        except BaseException:
            engine.shutdown()
            raise
    return engine


def on_loop(engine: Engine, fn: Callable[[Scheduler], Any]) -> Any:
    """fn(scheduler) between the engine's steps; its result, or its exception raised here."""
    done: Future[Any] = Future()

    def call(sched: Scheduler) -> None:
        try:
            done.set_result(fn(sched))
        except BaseException as exc:  # an AssertionError must reach the test, not the loop
            done.set_exception(exc)

    engine.loop.apply(call)
    return done.result(timeout=30)


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out: {what}")
        time.sleep(0.01)


def quiet(sched: Scheduler) -> bool:
    """No step, backup, store or prefetch of the storage tier is left to finish."""
    tier = sched.storage
    return (
        not sched.has_work()
        and (sched.host is None or not sched.host.allocator.busy)
        and (tier is None or (not tier._ops and not tier.stores and not tier.prefetches))
    )


def check_no_leaks(engine: Engine) -> None:
    """Once the storage tier's work is done: the invariants of both tiers hold, and a flush
    gives back every device and host slot."""
    wait_for(lambda: on_loop(engine, quiet), "the storage tier's work to finish")
    on_loop(engine, lambda sched: sched.check_invariants())
    assert engine.flush_cache()
    wait_for(lambda: on_loop(engine, quiet), "the flush's stores to finish")
    on_loop(engine, lambda sched: sched.check_invariants())
    info = engine.server_info()
    assert info["free_slots"] == info["num_slots"]
    assert info["host_free_slots"] == info["host_slots"]


def timed(engine: Engine) -> tuple[dict[str, Any], float]:
    start = time.perf_counter()
    out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    return out, time.perf_counter() - start


def details(out: dict[str, Any]) -> dict[str, int]:
    return out["meta_info"]["cached_tokens_details"]


@pytest.fixture(scope="module")
def stored(tiny, reference, tmp_path_factory) -> dict[str, bytes]:
    """The prompt's pages, as one engine wrote them to storage while serving it."""
    store = FakeStore()
    with storage_engine(tiny, tmp_path_factory.mktemp("fill"), store) as engine:
        out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert out["output_ids"] == reference
        assert details(out) == {"device": 0, "host": 0, "storage": 0}
        wait_for(lambda: len(store.pages) >= PAGES, "the prompt's pages in storage")
        check_no_leaks(engine)
    # Named as PageKeys names them; every full page of the prompt (and of its first 7
    # output tokens, which make no 16th page), each every layer's and head's K and V.
    assert set(store.pages) == set(expected_keys(tiny))
    assert {len(page) for page in store.pages.values()} == {page_bytes()}
    return store.pages


def test_wait_complete_waits_for_every_page(tiny, tmp_path, reference):
    store = FakeStore(delay=0.05)
    with storage_engine(
        tiny, tmp_path, store, hicache_storage_prefetch_policy="wait_complete"
    ) as engine:
        first = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert first["output_ids"] == reference
        wait_for(lambda: len(store.pages) >= PAGES, "the prompt's pages in storage")
        wait_for(lambda: on_loop(engine, quiet), "the first request's work to finish")
        assert engine.flush_cache()  # device and host tiers empty: only storage has it
        assert engine.server_info()["host_cached_tokens"] == 0
        again, elapsed = timed(engine)
        assert details(again) == {"device": 0, "host": 0, "storage": PAGES * STORAGE_PAGE}
        assert again["meta_info"]["cached_tokens"] == PAGES * STORAGE_PAGE
        assert again["output_ids"] == reference
        # PREFETCH_AHEAD gets at once, 50 ms each, for every page before it was admitted.
        assert elapsed >= math.ceil(PAGES / PREFETCH_AHEAD) * 0.05
        assert store.gets == PAGES
        info = engine.server_info()
        assert info["storage_pages_stored"] == PAGES
        assert (info["storage_prefetches"], info["storage_prefetch_pages"]) == (1, PAGES)
        check_no_leaks(engine)


def test_a_replica_configured_otherwise_reads_the_same_pages(tiny, tmp_path, reference, stored):
    """Another engine (a restart, another replica) with another device page size and host
    layout finds the pages the first one wrote: keys and stored form ignore both."""
    store = FakeStore(dict(stored))
    with storage_engine(
        tiny, tmp_path, store, page_size=4, hicache_mem_layout="page_first",
        hicache_storage_prefetch_policy="wait_complete",
    ) as engine:
        out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert details(out)["storage"] == PAGES * STORAGE_PAGE
        assert out["output_ids"] == reference
        check_no_leaks(engine)


def test_timeout_admits_at_its_deadline_with_the_pages_arrived(tiny, tmp_path, reference, stored):
    keys = expected_keys(tiny)
    store = FakeStore(dict(stored))
    store.slow[keys[4]] = 1.5  # pages 0-3 at once; page 4, and so every later one, at 1.5 s
    timeout = 0.2
    with storage_engine(
        tiny, tmp_path, store, hicache_storage_prefetch_policy="timeout",
        hicache_storage_prefetch_timeout=timeout,
    ) as engine:
        out, elapsed = timed(engine)
        assert details(out) == {"device": 0, "host": 0, "storage": 4 * STORAGE_PAGE}
        assert out["output_ids"] == reference
        assert elapsed >= timeout
        # The rest of the prefetch lands after the request; its slots return all the same.
        check_no_leaks(engine)
        assert store.gets == PAGES


def test_best_effort_on_an_idle_engine_does_not_wait(tiny, tmp_path, reference, stored):
    store = FakeStore(dict(stored), delay=0.25)
    with storage_engine(
        tiny, tmp_path, store, hicache_storage_prefetch_policy="best_effort"
    ) as engine:
        out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert details(out)["storage"] == 0  # admitted at once: nothing had arrived
        assert out["output_ids"] == reference
        # Whatever storage still does for it, both tiers add up meanwhile.
        on_loop(engine, lambda sched: sched.check_invariants())
        check_no_leaks(engine)


def test_best_effort_fetches_while_a_request_queues(tiny, tmp_path, reference, stored):
    """One request at a time: the prompt queues behind another, and its pages arrive
    meanwhile, so best_effort admits it with all of them."""
    store = FakeStore(dict(stored), delay=0.0)
    with storage_engine(
        tiny, tmp_path, store, hicache_storage_prefetch_policy="best_effort",
        max_running_requests=1, schedule_policy="fcfs",
    ) as engine:
        first: Future[dict[str, Any]] = Future()

        def run() -> None:
            try:
                first.set_result(engine.generate(
                    input_ids=list(range(1, 51)),
                    sampling_params={"max_new_tokens": 40, "temperature": 0, "ignore_eos": True},
                ))
            except BaseException as exc:
                first.set_exception(exc)

        threading.Thread(target=run, daemon=True).start()
        wait_for(lambda: engine.server_info()["running"] == 1, "the first request to run")
        out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert len(first.result(timeout=30)["output_ids"]) == 40
        assert details(out) == {"device": 0, "host": 0, "storage": PAGES * STORAGE_PAGE}
        assert out["output_ids"] == reference
        check_no_leaks(engine)


def generate_aside(engine: Engine, rid: str) -> Future[dict[str, Any]]:
    """PROMPT generated greedily on a thread of its own: its answer, or what it raised."""
    answer: Future[dict[str, Any]] = Future()

    def run() -> None:
        try:
            answer.set_result(engine.generate(input_ids=PROMPT, sampling_params=GREEDY, rid=rid))
        except BaseException as exc:
            answer.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return answer


def test_pages_arrived_after_an_abort_join_the_tree(tiny, tmp_path, reference, stored):
    """A request aborted while it waits for storage: its prefetch runs on, and its pages
    join the tree (host-only) for the next request, which loads them from the host tier."""
    store = FakeStore(dict(stored), delay=0.2)
    with storage_engine(
        tiny, tmp_path, store, hicache_storage_prefetch_policy="wait_complete"
    ) as engine:
        aborted = generate_aside(engine, "gone")
        wait_for(lambda: store.gets > 0, "the prefetch to start")
        engine.abort("gone")
        out = aborted.result(timeout=10)
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert out["output_ids"] == []
        wait_for(lambda: on_loop(engine, quiet), "the prefetch to finish")
        on_loop(engine, lambda sched: sched.check_invariants())
        assert engine.server_info()["host_cached_tokens"] == PAGES * STORAGE_PAGE
        again = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert details(again) == {"device": 0, "host": PAGES * STORAGE_PAGE, "storage": 0}
        assert again["output_ids"] == reference
        assert store.gets == PAGES  # read once
        check_no_leaks(engine)


def test_requests_sharing_a_prefix_at_once(tiny, tmp_path, references, stored):
    store = FakeStore(dict(stored), delay=0.02)
    with storage_engine(
        tiny, tmp_path, store, hicache_storage_prefetch_policy="wait_complete"
    ) as engine:
        outs = engine.generate(input_ids=[PROMPT, VARIANT, PROMPT], sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == [
            references["prompt"], references["variant"], references["prompt"]
        ]
        for out in outs:
            meta = out["meta_info"]
            assert meta["cached_tokens"] == sum(meta["cached_tokens_details"].values())
            assert meta["cached_tokens"] >= 896  # every one found the shared pages somewhere
        assert sum(details(o)["storage"] for o in outs) >= PAGES * STORAGE_PAGE
        check_no_leaks(engine)


def test_storage_keeps_namespaces_apart(tiny, tmp_path, reference):
    store = FakeStore()
    with storage_engine(
        tiny, tmp_path, store, hicache_storage_prefetch_policy="wait_complete"
    ) as engine:

        def serve(salt: str | None) -> dict[str, int]:
            out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, cache_salt=salt)
            assert out["output_ids"] == reference
            wait_for(lambda: on_loop(engine, quiet), "the storage tier's work to finish")
            assert engine.flush_cache()
            return details(out)

        assert serve("tenant-a")["storage"] == 0
        assert len(store.pages) == PAGES
        assert serve("tenant-b")["storage"] == 0  # tenant-a's pages are not tenant-b's
        assert serve(None)["storage"] == 0
        assert serve("tenant-a")["storage"] == PAGES * STORAGE_PAGE
        assert serve("tenant-b")["storage"] == PAGES * STORAGE_PAGE
        assert len(store.pages) == 3 * PAGES
        check_no_leaks(engine)


# ---- the engine: faults --------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["corrupt", "unreachable", "hangs", "wrong size", "missing"])
def test_a_bad_page_in_the_middle_ends_the_prefetch_there(
    tiny, tmp_path, reference, stored, fault, monkeypatch
):
    bad = 7
    key = expected_keys(tiny)[bad]
    store = FakeStore(dict(stored))
    if fault == "corrupt":
        store.faults[key] = CorruptPage
    elif fault == "unreachable":
        store.faults[key] = ConnectionError
    elif fault == "hangs":
        monkeypatch.setattr(page_mover, "PAGE_TIMEOUT_S", 0.5)
        store.slow[key] = 60.0
    elif fault == "wrong size":
        store.pages[key] = store.pages[key][:1000]
    else:  # removed between the query and the read (evicted by another writer)
        real_get = store.get

        async def get(k):
            if k == key:
                store.pages.pop(k, None)
            return await real_get(k)

        store.get = get  # type: ignore[method-assign]
    with storage_engine(
        tiny, tmp_path, store, hicache_storage_prefetch_policy="wait_complete"
    ) as engine:
        out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert details(out) == {"device": 0, "host": 0, "storage": bad * STORAGE_PAGE}
        assert out["output_ids"] == reference
        if fault in ("corrupt", "wrong size", "missing"):
            # The request computed the page again, and it replaces the bad or lost one.
            wait_for(lambda: key in store.written, "the page written again")
            assert len(store.pages[key]) == page_bytes()
        check_no_leaks(engine)


@pytest.mark.parametrize("fault", ["down", "full", "unreachable at start"])
def test_serving_goes_on_when_storage_fails(tiny, tmp_path, reference, fault):
    store = FakeStore()
    store.down = fault == "down"
    store.full = fault == "full"
    backend: FakeStore | Exception = store
    if fault == "unreachable at start":
        backend = ConnectionError("cannot reach the fake store")
    with storage_engine(
        tiny, tmp_path, backend, hicache_storage_prefetch_policy="wait_complete"
    ) as engine:
        for _ in range(2):
            out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
            assert out["output_ids"] == reference
            assert details(out)["storage"] == 0
            check_no_leaks(engine)  # flushes: the second request has only storage to try
        # The host tier serves all the while.
        engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        again = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert again["meta_info"]["cached_tokens"] > 0 and again["output_ids"] == reference
        assert engine.server_info()["host_slots"] > 0
    assert store.pages == {}
    if fault == "full":
        assert store.puts >= PAGES  # it was asked, and said no


class SlowQueries(FakeStore):
    """Its queries take three seconds (a store that answers slowly, or not at all until the
    storage call's own timeout); the writer's (one key at a time) do not."""

    async def exists(self, keys):
        if len(keys) > 1:
            await asyncio.sleep(3.0)
        return await super().exists(keys)


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
def test_a_slow_storage_query_does_not_hold_up_requests(tiny, tmp_path, reference, stored,
                                                        policy):
    """The query counts against the policy like the pages: best_effort does not wait for
    its answer, timeout no longer than its deadline."""
    store = SlowQueries(dict(stored))
    with storage_engine(
        tiny, tmp_path, store, hicache_storage_prefetch_policy=policy,
        hicache_storage_prefetch_timeout=0.2,
    ) as engine:
        out, elapsed = timed(engine)
        assert out["output_ids"] == reference
        assert details(out)["storage"] == 0
        assert elapsed < 3.0  # not the query's 3 s
        if policy == "timeout":
            assert elapsed >= 0.2
        check_no_leaks(engine)


class UnreadableMetadata(FakeStore):
    """exists() raises CorruptPage when asked about a `bad` key, as NatsBackend's does for
    an object whose metadata does not parse (nats-py's BadObjectMetaError)."""

    def __init__(self, bad: set[str], pages: dict[str, bytes] | None = None) -> None:
        super().__init__(pages)
        self.bad = bad

    async def exists(self, keys):
        if self.bad.intersection(keys):
            raise CorruptPage("unreadable object metadata")
        return await super().exists(keys)


def test_a_query_that_fails_otherwise_than_oserror_does_not_hang(tiny, tmp_path, reference,
                                                                 stored):
    store = UnreadableMetadata({expected_keys(tiny)[3]}, dict(stored))
    # wait_complete: no deadline ends the wait for storage's answer.
    with storage_engine(
        tiny, tmp_path, store, hicache_storage_prefetch_policy="wait_complete"
    ) as engine:
        done = generate_aside(engine, "q")
        try:
            out = done.result(timeout=3)
        except TimeoutError:
            engine.abort("q")
            raise AssertionError("the request still waits for storage's answer") from None
        assert out["output_ids"] == reference


def test_one_odd_write_error_does_not_stop_later_writes(tiny, tmp_path, reference,
                                                        monkeypatch):
    monkeypatch.setattr(host_pool, "CLOSE_FLUSH_S", 0.1)  # the queue never drains
    store = UnreadableMetadata({expected_keys(tiny)[0]})  # the first page's only
    # No query (it would hang on that page: the test above), only writes.
    with storage_engine(tiny, tmp_path, store, hicache_storage_prefetch_threshold=4096) as engine:
        out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert out["output_ids"] == reference
        wait_for(lambda: len(store.pages) >= PAGES - 1, "the other pages in storage", 3.0)


# ---- settings -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"hicache_storage_backend": "s3"}, "hicache_storage_backend"),
        (
            {"hicache_storage_backend": "file", "hicache_storage_backend_extra_config": "{"},
            "hicache_storage_backend_extra_config",
        ),
        (
            {
                "hicache_storage_backend": "file",
                "hicache_storage_backend_extra_config": '{"bucket": "kv"}',
            },
            "hicache_storage_backend_extra_config",
        ),
        (
            {"hicache_storage_backend": "redis",
             "hicache_storage_backend_extra_config": '{"url": "http://x"}'},
            "redis",
        ),
    ],
)
def test_bad_storage_settings_name_the_setting(settings, named):
    with pytest.raises(ValueError, match=named):
        Engine(**settings)

