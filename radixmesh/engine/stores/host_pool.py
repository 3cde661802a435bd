"""cachectl's domain: the engines' host (L2) KV tiers as shared-memory segments, one file per
engine in a tmpfs directory that the engine's workers map, which of their slots the
engine's scheduler holds, and (with a storage tier) the PageMover of each segment. No
transport: the gRPC service and the in-process LocalCachectl (radixmesh.Engine's) both
wrap HostSegments.

Without a storage tier cachectl never maps a segment: it only creates, sizes and unlinks the
file, so the memory is touched by the workers alone, page by page as they copy into it."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import string
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

from radixmesh.core.hicache import DTYPE_BYTES, LAYOUTS, HostPoolSpec, KVGeometry
from radixmesh.engine.stores.page_mover import PageMover, StorageStats
from radixmesh.engine.stores.storage import StorageBackend

log = logging.getLogger("radixmesh.cachectl")

SEGMENT_PREFIX = "radixmesh-hicache-"
_TOKEN_HEX = 16  # hex digits of the random part that ends a segment's name
_SAFE_BYTES = frozenset((string.ascii_letters + string.digits + ".").encode())
_MAX_ID_CHARS = 128  # of the escaped engine id: keeps the name far below NAME_MAX (255)


class NoSegment(LookupError):
    """The engine has no open segment here (never opened, or cachectl restarted since)."""


class SegmentStats(NamedTuple):
    """An engine's segment: its size and its use."""

    num_slots: int
    used_slots: int
    nbytes: int
    repeated: int  # slots recorded while in use or forgotten while free, since open


def escaped_engine_id(engine_id: str) -> str:
    """`engine_id` as a file name part: letters, digits and dots kept, every other byte as
    _xx. One-to-one, and free of "-", so that one engine's names never match another's."""
    return "".join(chr(b) if b in _SAFE_BYTES else f"_{b:02x}" for b in engine_id.encode())


def segment_names(engine_id: str) -> re.Pattern[str]:
    """The names of the engine's segments, whichever cachectl instance created them."""
    return re.compile(
        re.escape(f"{SEGMENT_PREFIX}{escaped_engine_id(engine_id)}-") + f"[0-9a-f]{{{_TOKEN_HEX}}}"
    )


def check_pool(geometry: KVGeometry, num_slots: int, layout: str) -> None:
    """Raise ValueError unless the geometry, size and layout make a host pool."""
    g = geometry
    dims = {"num_layers": g.num_layers, "num_kv_heads": g.num_kv_heads,
            "head_dim": g.head_dim, "page_size": g.page_size}
    bad = [f"{name}={value}" for name, value in dims.items() if value < 1]
    if bad:
        raise ValueError(f"geometry needs positive sizes, got {', '.join(bad)}")
    if g.dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {g.dtype!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if num_slots < 1 or num_slots % g.page_size:
        raise ValueError(
            f"num_slots must be a positive multiple of the page size {g.page_size}, "
            f"got {num_slots}"
        )


@dataclass
class _Segment:
    spec: HostPoolSpec
    used: np.ndarray  # bool per slot: the scheduler holds it
    mover: PageMover | None  # with a storage tier
    used_count: int = 0
    repeated: int = 0


class HostSegments:
    """The segments of the engines one cachectl serves, under `shm_dir`, and the storage
    tier they share (`storage`, when there is one), counting what storage did in `stats`."""

    def __init__(
        self,
        shm_dir: str | Path,
        storage: StorageBackend | None = None,
        stats: StorageStats | None = None,
    ) -> None:
        self.shm_dir = Path(shm_dir)
        self.shm_dir.mkdir(parents=True, exist_ok=True)
        self.storage = storage
        self.storage_stats = stats
        self._segments: dict[str, _Segment] = {}

    def open(
        self,
        engine_id: str,
        geometry: KVGeometry,
        num_slots: int,
        layout: str,
        storage_page_tokens: int = 0,
    ) -> HostPoolSpec:
        """A fresh segment of `num_slots` slots for the engine, no slot in use. The engine's
        previous segment, and any an earlier cachectl left behind, are unlinked first: a
        worker that still maps one keeps its memory until it maps the new one. With a
        storage tier, its pages hold `storage_page_tokens` tokens (0: no storage for it)."""
        if not engine_id:
            raise ValueError("engine_id must not be empty")
        check_pool(geometry, num_slots, layout)
        escaped = escaped_engine_id(engine_id)
        if len(escaped) > _MAX_ID_CHARS:
            raise ValueError(f"engine_id is too long for a segment name: {engine_id!r}")
        self._unlink_all(engine_id)
        name = f"{SEGMENT_PREFIX}{escaped}-{secrets.token_hex(_TOKEN_HEX // 2)}"
        spec = HostPoolSpec(name, str(self.shm_dir / name), num_slots, layout, geometry)
        if self.storage is not None and storage_page_tokens:
            if storage_page_tokens % geometry.page_size:
                raise ValueError(
                    f"storage pages of {storage_page_tokens} tokens are not whole pages of "
                    f"{geometry.page_size}"
                )
            spec = replace(spec, storage=self.storage.name)
        self._create(spec)
        mover = None
        if spec.storage:
            assert self.storage is not None
            mover = PageMover(engine_id, spec, self.storage, storage_page_tokens,
                              stats=self.storage_stats)
        self._segments[engine_id] = _Segment(spec, np.zeros(num_slots, dtype=bool), mover)
        log.info("engine %s: host segment %s, %d slots (%.2f GB, %s), storage %s",
                 engine_id, spec.path, num_slots, spec.nbytes / 1e9, layout,
                 spec.storage or "none")
        return spec

    def _create(self, spec: HostPoolSpec) -> None:
        # A tmpfs file is sparse: a segment larger than the room left would be created fine
        # and only fail later, as SIGBUS in the worker that touches its missing pages.
        room = os.statvfs(self.shm_dir)
        free = room.f_bavail * room.f_frsize
        if spec.nbytes > free:
            raise OSError(
                errno.ENOSPC,
                f"a host segment of {spec.nbytes / 1e9:.2f} GB does not fit in {self.shm_dir} "
                f"({free / 1e9:.2f} GB free); lower hicache_ratio or hicache_size",
            )
        fd = os.open(spec.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, spec.nbytes)
        except OSError:
            os.unlink(spec.path)
            raise
        finally:
            os.close(fd)

    def _unlink_all(self, engine_id: str) -> None:
        """Unlink the engine's segment and every other file named as one of its segments."""
        self.drop(engine_id)
        names = segment_names(engine_id)
        for entry in os.scandir(self.shm_dir):
            if names.fullmatch(entry.name):
                Path(entry.path).unlink(missing_ok=True)
                log.info("engine %s: stale host segment %s unlinked", engine_id, entry.path)

    def spec(self, engine_id: str) -> HostPoolSpec:
        """The engine's open segment."""
        return self._segment(engine_id).spec

    def engines(self) -> list[str]:
        """The engines with an open segment."""
        return list(self._segments)

    def record(self, engine_id: str, slots: Sequence[int]) -> int:
        """Mark slots in use; how many of them were in use already (logged, then ignored)."""
        return self._mark(engine_id, slots, True)

    def forget(self, engine_id: str, slots: Sequence[int]) -> int:
        """Mark slots free; how many of them were free already (logged, then ignored)."""
        return self._mark(engine_id, slots, False)

    def _mark(self, engine_id: str, slots: Sequence[int], in_use: bool) -> int:
        segment = self._segment(engine_id)
        wanted = np.asarray(slots, dtype=np.int64)
        if wanted.size == 0:
            return 0
        num_slots = segment.spec.num_slots
        if wanted.min() < 0 or wanted.max() >= num_slots:
            outside = wanted[(wanted < 0) | (wanted >= num_slots)]
            raise ValueError(
                f"engine {engine_id}: slots {outside[:8].tolist()} are outside its host pool "
                f"of {num_slots} slots"
            )
        unique = np.unique(wanted)
        already = int(np.count_nonzero(segment.used[unique] == in_use))
        segment.used[unique] = in_use
        changed = unique.size - already
        segment.used_count += changed if in_use else -changed
        repeated = wanted.size - changed
        if repeated:
            segment.repeated += repeated
            log.warning("engine %s: %d of %d slots %s were %s already", engine_id, repeated,
                        wanted.size, "recorded" if in_use else "forgotten",
                        "in use" if in_use else "free")
        return repeated

    def stats(self, engine_id: str) -> SegmentStats:
        s = self._segment(engine_id)
        return SegmentStats(s.spec.num_slots, s.used_count, s.spec.nbytes, s.repeated)

    @property
    def total_bytes(self) -> int:
        """Bytes of every open segment."""
        return sum(s.spec.nbytes for s in self._segments.values())

    def mover(self, engine_id: str) -> PageMover:
        """The PageMover of the engine's segment; LookupError when it has no storage tier."""
        mover = self._segment(engine_id).mover
        if mover is None:
            raise NoSegment(f"engine {engine_id!r} has no storage tier")
        return mover

    def store(self, engine_id: str, pages: Sequence[tuple[str, Sequence[int]]]) -> int:
        """Queue the engine's host pages for storage; how many were taken."""
        return self.mover(engine_id).store(pages)

    async def query(self, engine_id: str, keys: Sequence[str]) -> int:
        """How many of the keys, from the first on, storage holds."""
        return await self.mover(engine_id).query(keys)

    def prefetch(
        self, engine_id: str, keys: Sequence[str], slots: Sequence[int]
    ) -> AsyncIterator[int]:
        """Read pages from storage into the engine's host slots (PageMover.prefetch)."""
        return self.mover(engine_id).prefetch(keys, slots)

    def drop(self, engine_id: str) -> None:
        """Unlink the engine's segment, if it has one."""
        if (segment := self._segments.pop(engine_id, None)) is not None:
            if segment.mover is not None:
                segment.mover.close()
            Path(segment.spec.path).unlink(missing_ok=True)
            log.info("engine %s: host segment %s unlinked", engine_id, segment.spec.path)

    def close(self) -> None:
        """Unlink every segment."""
        for engine_id in list(self._segments):
            self.drop(engine_id)

    def _segment(self, engine_id: str) -> _Segment:
        try:
            return self._segments[engine_id]
        except KeyError:
            raise NoSegment(f"engine {engine_id!r} has no open host segment") from None


CLOSE_FLUSH_S = 5.0  # how long closing waits for queued storage writes
IN_PROCESS = "inprocess"  # engine ids of in-process engines: inprocess-<pid>-<hex>


def in_process_engine_id() -> str:
    """A fresh engine id for an in-process engine, naming this process."""
    return f"{IN_PROCESS}-{os.getpid()}-{secrets.token_hex(4)}"


def _dead_process_segments(shm_dir: Path) -> list[Path]:
    """Segments of in-process engines whose process is gone (it was killed before it could
    unlink them)."""
    pattern = re.compile(
        re.escape(SEGMENT_PREFIX + escaped_engine_id(f"{IN_PROCESS}-")) + r"(\d+)_2d"
    )
    dead = []
    for entry in os.scandir(shm_dir):
        match = pattern.match(entry.name)
        if match is None:
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            dead.append(Path(entry.path))
        except PermissionError:
            pass  # alive, another user's
    return dead


class LocalCachectl:
    """The host tier's owner in process (radixmesh.Engine's HostTierClient): the domain,
    without sockets. close() unlinks the segment; opening one first unlinks those that
    in-process engines of dead processes left behind, and connects to the storage tier
    (`open_storage`) if there is one and it is not connected yet."""

    def __init__(
        self,
        shm_dir: str | Path,
        open_storage: Callable[[], Awaitable[StorageBackend]] | None = None,
    ) -> None:
        self.segments = HostSegments(shm_dir)
        self._open_storage = open_storage
        self._engine_id: str | None = None

    async def open(
        self,
        engine_id: str,
        geometry: KVGeometry,
        num_slots: int,
        layout: str,
        storage_page_tokens: int = 0,
    ) -> HostPoolSpec:
        if self._engine_id is not None and self._engine_id != engine_id:
            self.segments.drop(self._engine_id)
        for path in _dead_process_segments(self.segments.shm_dir):
            path.unlink(missing_ok=True)
            log.info("host segment %s of a dead process unlinked", path)
        if self._open_storage is not None and self.segments.storage is None:
            try:
                self.segments.storage = await self._open_storage()
            except OSError as exc:
                log.warning("storage tier unreachable (%s): the host tier serves alone", exc)
        spec = self.segments.open(engine_id, geometry, num_slots, layout, storage_page_tokens)
        self._engine_id = engine_id
        return spec

    async def record(self, slots: list[int]) -> None:
        self.segments.record(self._opened(), slots)

    async def forget(self, slots: list[int]) -> None:
        self.segments.forget(self._opened(), slots)

    async def store(self, pages: Sequence[tuple[str, Sequence[int]]]) -> int:
        return self.segments.store(self._opened(), pages)

    async def query(self, keys: Sequence[str]) -> int:
        return await self.segments.query(self._opened(), keys)

    async def prefetch(self, keys: Sequence[str], slots: Sequence[int]) -> AsyncIterator[int]:
        async for arrived in self.segments.prefetch(self._opened(), keys, slots):
            yield arrived

    def stats(self) -> SegmentStats:
        return self.segments.stats(self._opened())

    async def close(self) -> None:
        """Unlink the segment; the storage backend is closed too (writes still queued are
        given a moment first)."""
        if self._engine_id is not None and self.segments.storage is not None:
            with contextlib.suppress(NoSegment):
                await self.segments.mover(self._engine_id).flush(CLOSE_FLUSH_S)
        self.segments.close()
        self._engine_id = None
        if self.segments.storage is not None:
            await self.segments.storage.close()

    def _opened(self) -> str:
        if self._engine_id is None:
            raise RuntimeError("the host tier is not open")
        return self._engine_id
