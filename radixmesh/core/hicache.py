"""The host (L2) KV tier's contract: what the scheduler, the worker and cachectl agree on.

cachectl owns one shared-memory segment per engine; the worker on the same host maps it
and copies pages between it and its device KV pool; the scheduler decides what goes where
and allocates the segment's slots (it already owns every other slot decision). A host slot
holds one token's K and V of every layer and every KV head; a tensor-parallel rank copies
its own heads."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

from radixmesh.core.flags import Settings, setting

LAYOUTS = ("layer_first", "page_first")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
STORAGE_BACKENDS = ("file", "redis", "nats")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# What each storage backend's extra config may hold, and the defaults filled in.
_STORAGE_KEYS = {"file": ("path",), "redis": ("url",), "nats": ("bucket", "url")}
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_NATS_BUCKET = "radixmesh-kv"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"  # the nats backend's, for an in-process engine


def shm_root() -> str:
    """Where host tier segments live by default: a tmpfs where there is one."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one token's KV across the whole model (every rank's heads)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # a key of DTYPE_BYTES
    page_size: int = 1

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K and V over every layer and head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class HostPoolSpec:
    """Where an engine's host pool lives and how its bytes are laid out.

    layer_first: [num_layers, 2 (K, V), num_slots, num_kv_heads, head_dim], so one layer's
    slots are contiguous; page_first: [num_pages, num_layers, 2, page_size, num_kv_heads,
    head_dim], so one page of every layer is contiguous (what a storage tier moves)."""

    name: str  # the shared-memory segment's name (under /dev/shm on Linux)
    path: str  # the segment file's full path, which the worker maps
    num_slots: int  # tokens; a multiple of the page size
    layout: str  # one of LAYOUTS
    geometry: KVGeometry
    storage: str = ""  # the storage (L3) tier behind it: one of STORAGE_BACKENDS, or none

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.geometry.token_bytes

    def shape(self) -> tuple[int, ...]:
        """The segment as an array of dtype elements, per the layout."""
        g = self.geometry
        if self.layout == "layer_first":
            return (g.num_layers, 2, self.num_slots, g.num_kv_heads, g.head_dim)
        pages = self.num_slots // g.page_size
        return (pages, g.num_layers, 2, g.page_size, g.num_kv_heads, g.head_dim)


def host_pool_slots(
    device_slots: int, geometry: KVGeometry, ratio: float, size_gb: float
) -> int:
    """Host slots for a device pool of `device_slots`: `size_gb` GB when set (> 0), else
    `ratio` times the device pool; rounded down to whole pages."""
    if size_gb > 0:
        slots = int(size_gb * 1e9) // geometry.token_bytes
    else:
        slots = int(device_slots * ratio)
    return slots - slots % geometry.page_size


def default_storage_dir() -> Path:
    """Where the file storage tier keeps its pages unless told: the user's cache directory."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "radixmesh" / "hicache"


def storage_config(backend: str, text: str) -> dict[str, str]:
    """The storage backend's extra config, read from its JSON text, defaults filled in;
    ValueError naming what is wrong."""
    if backend not in _STORAGE_KEYS:
        if text.strip():
            raise ValueError("hicache_storage_backend_extra_config needs a storage backend")
        return {}
    try:
        config = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"hicache_storage_backend_extra_config is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError("hicache_storage_backend_extra_config must be a JSON object")
    allowed = _STORAGE_KEYS[backend]
    for key, value in config.items():
        if key not in allowed:
            raise ValueError(
                f"hicache_storage_backend_extra_config: {key!r} is not a setting of the "
                f"{backend} backend (it takes {', '.join(allowed)})"
            )
        if not isinstance(value, str) or not value:
            raise ValueError(
                f"hicache_storage_backend_extra_config: {key!r} must be a non-empty string"
            )
    defaults = {
        "file": {"path": str(default_storage_dir())},
        "redis": {"url": DEFAULT_REDIS_URL},
        "nats": {"bucket": DEFAULT_NATS_BUCKET},
    }[backend]
    config = {**defaults, **config}
    if backend == "redis" and not config["url"].startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(
            "hicache_storage_backend_extra_config: the redis backend's url must be "
            f"redis://HOST:PORT/DB, got {config['url']!r}"
        )
    return config


class PageKeys:
    """Names of storage pages: the key of page i (tokens [i*P, (i+1)*P) of a prefix) hashes
    the key of page i-1 with page i's token ids, so one key names a whole prefix. Page -1's
    key hashes the model (its weights' fingerprint and KV geometry, dtype included), the
    page size and the cache namespace (cache_salt), so keys never mix models or tenants.

    A stored page holds every layer's and every KV head's K and V of its tokens, in one
    order whatever the host layout or tensor parallelism: those stay out of the key, so
    replicas configured differently share pages."""

    VERSION = b"radixmesh-kv/1"

    def __init__(self, model_fingerprint: str, geometry: KVGeometry, page_tokens: int) -> None:
        self.page_tokens = page_tokens
        g = geometry
        self._model = b"|".join(
            str(v).encode()
            for v in (model_fingerprint, g.num_layers, g.num_kv_heads, g.head_dim, g.dtype,
                      page_tokens)
        )
        self._roots: dict[str | None, bytes] = {}

    def keys(self, tokens: Sequence[int], namespace: str | None, pages: int) -> list[str]:
        """Keys of the first `pages` pages of `tokens` (which holds at least that many)."""
        if pages * self.page_tokens > len(tokens):
            raise ValueError(f"{len(tokens)} tokens hold no {pages} pages of {self.page_tokens}")
        key = self._root(namespace)
        keys = []
        p = self.page_tokens
        for i in range(pages):
            page = struct.pack(f"<{p}i", *tokens[i * p : (i + 1) * p])
            key = hashlib.blake2b(key + page, digest_size=16).digest()
            keys.append(key.hex())
        return keys

    def _root(self, namespace: str | None) -> bytes:
        root = self._roots.get(namespace)
        if root is None:
            salt = b"" if namespace is None else b"salt:" + namespace.encode()
            text = self.VERSION + self._model + b"|" + salt
            root = hashlib.blake2b(text, digest_size=16).digest()
            self._roots[namespace] = root
        return root


class HostTierClient(Protocol):
    """The scheduler's handle on the owner of its engine's host tier: cachectl over gRPC,
    or in process. Both raise ValueError for a request the pool cannot satisfy (a bug), and
    an OSError when the tier cannot be had or is lost (the gRPC client's is a
    ConnectionError): the scheduler then carries on without the host tier."""

    async def open(
        self,
        engine_id: str,
        geometry: KVGeometry,
        num_slots: int,
        layout: str,
        storage_page_tokens: int,
    ) -> HostPoolSpec:
        """A fresh segment for the engine, replacing the one it had; no slot in use. The
        spec names the storage tier behind it, whose pages hold `storage_page_tokens`."""

    async def record(self, slots: list[int]) -> None:
        """Host slots the scheduler now holds."""

    async def forget(self, slots: list[int]) -> None:
        """Host slots the scheduler no longer holds."""

    async def store(self, pages: Sequence[tuple[str, Sequence[int]]]) -> int:
        """Write these (key, host slots) pages to the storage tier. The call returns once
        the slots were read (they may be reused then); the writes go on behind it. Returns
        how many pages were taken (a full write queue drops the rest)."""

    async def query(self, keys: Sequence[str]) -> int:
        """How many of the keys, from the first on, the storage tier holds."""

    def prefetch(self, keys: Sequence[str], slots: Sequence[int]) -> AsyncIterator[int]:
        """Read these pages from storage into the host slots (page i into
        slots[i*P:(i+1)*P]), in order; yields how many pages have arrived so far, the last
        time once nothing more will be written (a missing or corrupt page ends it)."""

    async def close(self) -> None:
        """Let go of the host tier."""


# ---- the tiers' settings -------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class HiCacheSettings(Settings):
    """The hierarchical KV cache: a host (L2) tier behind the device pool (SGLang's names)."""

    TITLE: ClassVar[str] = "hierarchical cache"

    enable_hierarchical_cache: bool = setting(
        False,
        help="keep KV evicted from the device pool in a host-memory tier (owned by cachectl) "
        "and load it back instead of recomputing the prefix",
    )
    hicache_ratio: float = setting(
        2.0,
        minimum=1.0,
        help="size of the host tier as a multiple of the device KV pool",
    )
    hicache_size: float = setting(
        0.0,
        minimum=0.0,
        help="size of the host tier in GB, overriding hicache_ratio; 0: use hicache_ratio",
    )
    hicache_write_policy: str = setting(
        "write_through",
        choices=WRITE_POLICIES,
        help="when device KV is copied to the host tier: write_through (as soon as it is "
        "cached), write_through_selective (once hicache_write_through_threshold admissions "
        "hit it) or write_back (when it is evicted from the device pool)",
    )
    hicache_write_through_threshold: int = setting(
        2,
        minimum=1,
        help="admissions that must hit a cached prefix before write_through_selective "
        "copies it to the host tier",
    )
    hicache_mem_layout: str = setting(
        "layer_first",
        choices=LAYOUTS,
        help="host tier layout: layer_first (each layer's slots contiguous) or page_first "
        "(each page's layers contiguous)",
    )
    hicache_storage_page_size: int = setting(
        64,
        minimum=1,
        help="tokens per storage-tier page, the unit written to and read from storage (a "
        "multiple of page_size)",
    )
    hicache_storage_prefetch_policy: str = setting(
        "timeout",
        choices=PREFETCH_POLICIES,
        help="how long a request whose prefix storage holds waits for it: best_effort (until "
        "it would run anyway: on an idle engine, not at all), wait_complete (until every "
        "page arrived) or timeout (the same, but no longer than "
        "hicache_storage_prefetch_timeout)",
    )
    hicache_storage_prefetch_timeout: float = setting(
        2.0,
        minimum=0.0,
        help="seconds a request waits for its storage pages under the timeout prefetch policy",
    )
    hicache_storage_prefetch_threshold: int = setting(
        256,
        minimum=1,
        help="tokens that storage must hold beyond a request's device and host hit before "
        "they are fetched rather than recomputed",
    )

    def cross_check(self) -> None:
        super().cross_check()
        page_size = getattr(self, "page_size", 1)
        if self.hicache_storage_page_size % page_size:
            raise ValueError(
                f"hicache_storage_page_size must be a multiple of page_size {page_size}, "
                f"got {self.hicache_storage_page_size}"
            )


@dataclass(frozen=True, kw_only=True)
class HiCacheStorageSettings(Settings):
    """The storage (L3) tier behind the host tier, which cachectl reads and writes."""

    TITLE: ClassVar[str] = "hierarchical cache storage"

    hicache_storage_backend: str | None = setting(
        None,
        choices=STORAGE_BACKENDS,
        help="storage tier behind the host tier, shared by every engine that uses the same "
        "one and kept across restarts: file, redis or nats (the mesh's JetStream object "
        "store); empty: none",
    )
    hicache_storage_backend_extra_config: str = setting(
        "",
        help='the storage backend\'s settings as JSON: {"path": DIR} for file (default: '
        'radixmesh/hicache in the user\'s cache directory), {"url": "redis://HOST:PORT/DB"} '
        'for redis, {"bucket": NAME} for nats (and "url" for a NATS server other than the '
        "mesh's)",
    )

    def cross_check(self) -> None:
        super().cross_check()
        storage_config(
            self.hicache_storage_backend or "", self.hicache_storage_backend_extra_config
        )

    @property
    def storage_config(self) -> dict[str, str]:
        """The backend's extra config, defaults filled in."""
        return storage_config(
            self.hicache_storage_backend or "", self.hicache_storage_backend_extra_config
        )
