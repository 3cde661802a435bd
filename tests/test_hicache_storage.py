"""The storage (L3) KV tier behind the host tier in the in-process engine (a tiny
random-weight model): prefetching from a slow or failing fake store under each prefetch
policy, with the same output as without any cache and no slot leaks, and the storage
settings. Its parts alone (page keys, host-only nodes, PageMover) are tested in
test_storage_tier_parts.py."""

from __future__ import annotations

import asyncio
import errno
import json
import math
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from engine_helpers import in_thread
from tiny_model import EOS, HEAD_DIM, KV_HEADS, LAYERS, VOCAB, save_tiny_model
from tokenizers import models, pre_tokenizers

import radixmesh.api as engine_module
from radixmesh import Engine
from radixmesh.core.hicache import KVGeometry, PageKeys
from radixmesh.core.model_files import model_fingerprint
from radixmesh.engine.scheduler import Scheduler
from radixmesh.engine.stores import host_pool, page_mover
from radixmesh.engine.stores.page_mover import PREFETCH_AHEAD
from radixmesh.engine.stores.storage import CorruptPage

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
            wait_for(lambda: on_loop(engine, lambda s: s.tiers.host is not None), "no host tier")
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
    tier = sched.tiers.storage
    return (
        not sched.has_work()
        and (sched.tiers.host is None or not sched.tiers.host.allocator.busy)
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


def test_pages_arrived_after_an_abort_join_the_tree(tiny, tmp_path, reference, stored):
    """A request aborted while it waits for storage: its prefetch runs on, and its pages
    join the tree (host-only) for the next request, which loads them from the host tier."""
    store = FakeStore(dict(stored), delay=0.2)
    with storage_engine(
        tiny, tmp_path, store, hicache_storage_prefetch_policy="wait_complete"
    ) as engine:
        aborted = in_thread(engine.generate, input_ids=PROMPT, sampling_params=GREEDY, rid="gone")
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
        done = in_thread(engine.generate, input_ids=PROMPT, sampling_params=GREEDY, rid="q")
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

