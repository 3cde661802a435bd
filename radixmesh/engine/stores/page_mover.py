"""Moves one engine's KV pages between its host segment and the storage (L3) tier.

A stored page is the K and V of `page_tokens` tokens over every layer and KV head, as one
array [num_layers, 2, page_tokens, num_kv_heads, head_dim] whatever the host layout: the
segment's slots are gathered into it on the way out and scattered from it on the way in.

Writes never hold up the scheduler: store() copies the pages out of the segment (so their
slots may be reused at once) and queues them; one writer task sends them to storage,
skipping pages storage already holds (another replica wrote them). A full queue drops
pages rather than grow without bound. Reads (prefetch) fetch a few pages ahead and write
them into the segment in order; the first missing, corrupt or unreachable page ends it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from typing import TypeVar

import numpy as np

from radixmesh.core.hicache import HostPoolSpec
from radixmesh.engine.stores.storage import CorruptPage, StorageBackend

log = logging.getLogger("radixmesh.cachectl")

T = TypeVar("T")

_ELEMENT = {2: np.uint16, 4: np.uint32}  # bytes per element -> a type that copies bits
QUEUE_BYTES = 512 << 20  # pages queued for storage at most
PREFETCH_AHEAD = 4  # pages read from storage at once
PAGE_TIMEOUT_S = 10.0  # for one storage call; a slower store counts as unreachable


class StorageStats:
    """Where a mover counts what storage did. This one counts nothing (the in-process
    engine serves no metrics); cachectl's Prometheus metrics override every method."""

    def pages(self, backend: str, outcome: str, count: int = 1) -> None:
        """Pages by outcome: hit, miss, corrupt, read_error, written, already_stored,
        write_error, dropped."""

    def bytes(self, backend: str, direction: str, count: int) -> None:
        """Bytes read ("read") or written ("write")."""

    def queued(self, nbytes: int) -> None:
        """Bytes of pages waiting to be written."""

    def call(self, backend: str, op: str, seconds: float) -> None:
        """How long one storage call (get, put, exists) took."""


class PageMover:
    """The storage tier of one engine's host segment."""

    def __init__(
        self,
        engine_id: str,
        spec: HostPoolSpec,
        backend: StorageBackend,
        page_tokens: int,
        queue_bytes: int = QUEUE_BYTES,
        stats: StorageStats | None = None,
    ) -> None:
        g = spec.geometry
        if page_tokens < 1 or page_tokens % g.page_size:
            raise ValueError(
                f"storage pages of {page_tokens} tokens are not whole pages of {g.page_size}"
            )
        self.engine_id = engine_id
        self.spec = spec
        self.backend = backend
        self.page_tokens = page_tokens
        self.queue_bytes = queue_bytes
        self.stats = stats or StorageStats()
        element = _ELEMENT[g.token_bytes // (2 * g.num_layers * g.num_kv_heads * g.head_dim)]
        fd = os.open(spec.path, os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, spec.nbytes)
        finally:
            os.close(fd)
        self._pool = np.frombuffer(self._mmap, dtype=element).reshape(spec.shape())
        self._queue: deque[tuple[str, bytes]] = deque()
        self._queued_bytes = 0
        # Keys whose stored page failed its check: written again, not skipped as stored.
        self._corrupt: set[str] = set()
        self._closed = False
        self._wake = asyncio.Event()
        self._writer = asyncio.create_task(self._write_loop())

    # ---- pages in the segment ---------------------------------------------------------

    def read_page(self, slots: Sequence[int]) -> np.ndarray:
        """The page held by these host slots, as [layers, 2, tokens, heads, head_dim]."""
        index = np.asarray(slots, dtype=np.int64)
        if self.spec.layout == "layer_first":
            return self._pool[:, :, index]
        ps = self.spec.geometry.page_size
        # page_first: [pages, layers, 2, page_size, heads, dim] -> [tokens, layers, 2, ...]
        tokens = self._pool[index // ps, :, :, index % ps]
        return np.ascontiguousarray(tokens.transpose(1, 2, 0, 3, 4))

    def write_page(self, slots: Sequence[int], page: np.ndarray) -> None:
        """Put a page ([layers, 2, tokens, heads, head_dim]) into these host slots."""
        index = np.asarray(slots, dtype=np.int64)
        if self.spec.layout == "layer_first":
            self._pool[:, :, index] = page
        else:
            ps = self.spec.geometry.page_size
            self._pool[index // ps, :, :, index % ps] = page.transpose(2, 0, 1, 3, 4)

    def _page_shape(self) -> tuple[int, ...]:
        g = self.spec.geometry
        return (g.num_layers, 2, self.page_tokens, g.num_kv_heads, g.head_dim)

    def _check_slots(self, slots: Sequence[int], pages: int) -> None:
        if len(slots) != pages * self.page_tokens:
            raise ValueError(
                f"{len(slots)} slots for {pages} pages of {self.page_tokens} tokens"
            )
        if slots and (min(slots) < 0 or max(slots) >= self.spec.num_slots):
            raise ValueError(f"slots outside the host pool of {self.spec.num_slots} slots")

    # ---- writes ------------------------------------------------------------------------

    def store(self, pages: Sequence[tuple[str, Sequence[int]]]) -> int:
        """Copy the pages out of the segment and queue them for storage; how many were
        taken (the rest are dropped: the queue is full)."""
        taken = 0
        for key, slots in pages:
            self._check_slots(slots, 1)
            data = self.read_page(slots).tobytes()
            if self._queued_bytes + len(data) > self.queue_bytes:
                self.stats.pages(self.backend.name, "dropped", len(pages) - taken)
                break
            self._queue.append((key, data))
            self._queued_bytes += len(data)
            taken += 1
        self.stats.queued(self._queued_bytes)
        self._wake.set()
        return taken

    async def _write_loop(self) -> None:
        name = self.backend.name
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue and not self._closed:
                key, data = self._queue[0]
                try:
                    if key not in self._corrupt and (
                        await self._timed("exists", partial(self.backend.exists, [key]))
                    )[0]:
                        self.stats.pages(name, "already_stored")
                    else:
                        await self._timed("put", partial(self.backend.put, key, data))
                        self._corrupt.discard(key)
                        self.stats.pages(name, "written")
                        self.stats.bytes(name, "write", len(data))
                except (OSError, CorruptPage) as exc:
                    self.stats.pages(name, "write_error")
                    log.warning("engine %s: storage write of page %s failed: %s",
                                self.engine_id, key, exc)
                except Exception:  # a backend's surprise must not stop every later write
                    self.stats.pages(name, "write_error")
                    log.exception("engine %s: storage write of page %s failed",
                                  self.engine_id, key)
                if self._closed:
                    return  # close() emptied the queue meanwhile
                self._queue.popleft()
                self._queued_bytes -= len(data)
                self.stats.queued(self._queued_bytes)

    async def flush(self, timeout: float) -> None:
        """Wait (at most `timeout` s) until every queued page was written or failed."""
        deadline = time.monotonic() + timeout
        while self._queue and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    # ---- reads -------------------------------------------------------------------------

    async def query(self, keys: Sequence[str]) -> int:
        """How many of the keys, from the first on, storage holds (0 when unreachable)."""
        if not keys:
            return 0
        try:
            present = await self._timed("exists", partial(self.backend.exists, keys))
        except (OSError, CorruptPage) as exc:
            self.stats.pages(self.backend.name, "read_error")
            log.warning("engine %s: storage query failed: %s", self.engine_id, exc)
            return 0
        hits = next((i for i, there in enumerate(present) if not there), len(present))
        return hits

    async def prefetch(self, keys: Sequence[str], slots: Sequence[int]) -> AsyncIterator[int]:
        """Read the pages into the slots in order, yielding the pages arrived after each;
        ends at the first page that storage lacks, fails its checksum or cannot give."""
        self._check_slots(slots, len(keys))
        name, p = self.backend.name, self.page_tokens
        ahead: deque[asyncio.Task[bytes | memoryview | None]] = deque()
        arrived = 0
        try:
            while arrived < len(keys):
                while len(ahead) < PREFETCH_AHEAD and arrived + len(ahead) < len(keys):
                    key = keys[arrived + len(ahead)]
                    ahead.append(asyncio.ensure_future(
                        self._timed("get", partial(self.backend.get, key))
                    ))
                try:
                    data = await ahead.popleft()
                except CorruptPage as exc:
                    self._corrupt.add(keys[arrived])
                    self.stats.pages(name, "corrupt")
                    log.warning("engine %s: %s", self.engine_id, exc)
                    return
                except OSError as exc:
                    self.stats.pages(name, "read_error")
                    log.warning("engine %s: storage read failed: %s", self.engine_id, exc)
                    return
                if data is None:
                    self.stats.pages(name, "miss")
                    return
                if self._closed:
                    return
                page = np.frombuffer(data, dtype=self._pool.dtype)
                if page.size != int(np.prod(self._page_shape())):
                    self._corrupt.add(keys[arrived])
                    self.stats.pages(name, "corrupt")
                    log.warning("engine %s: storage page %s has %d bytes, not a page",
                                self.engine_id, keys[arrived], len(data))
                    return
                at = arrived * p
                self.write_page(slots[at : at + p], page.reshape(self._page_shape()))
                self.stats.pages(name, "hit")
                self.stats.bytes(name, "read", len(data))
                arrived += 1
                yield arrived
        finally:
            for task in ahead:
                task.cancel()
            for task in ahead:
                with contextlib.suppress(BaseException):
                    await task

    async def _timed(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        """One storage call, bounded by PAGE_TIMEOUT_S and timed; the coroutine is made
        here, so a task cancelled before it starts leaves none unawaited."""
        start = time.perf_counter()
        try:
            return await asyncio.wait_for(call(), PAGE_TIMEOUT_S)
        except TimeoutError as exc:
            raise TimeoutError(f"storage {op} took over {PAGE_TIMEOUT_S:g} s") from exc
        finally:
            self.stats.call(self.backend.name, op, time.perf_counter() - start)

    def close(self) -> None:
        """Stop writing (what is still queued is dropped) and unmap the segment; a prefetch
        still running ends at its next page."""
        self._closed = True
        self._writer.cancel()
        if self._queue:
            self.stats.pages(self.backend.name, "dropped", len(self._queue))
        self._queue.clear()
        self._queued_bytes = 0
        del self._pool  # the last view of the mapping, so that it can close
        self._mmap.close()
