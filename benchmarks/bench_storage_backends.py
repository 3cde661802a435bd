"""HiCache's storage backends alone: GB/s of moving KV pages through each one (file, redis,
nats), beside a plain memcpy of the same bytes, in one sitting.

Usage:
    python benchmarks/bench_storage_backends.py                       # 32 pages, 3 runs
    python benchmarks/bench_storage_backends.py --sides file,nats --pages 8 --runs 2

Pages are SmolLM2's real page (64 tokens x 30 layers x K,V x 3 KV heads x head_dim 64 x 2
bytes = 1.47 MB in bf16), random bytes. Each backend (radixmesh/engine/stores/storage.py's
open_backend) is timed on sequential puts, gets one at a time and PREFETCH_AHEAD at once, then
PageMover's store (exists + put, its one writer task) and prefetch (PREFETCH_AHEAD ahead,
scattered into a host segment); medians of --runs, fresh keys every run. redis runs on a
redis-server of the sitting's own on a free port (skipped, with the reason, without the
binary); nats on a NATS server of its own with JetStream (an object store bucket).
bench_hicache_storage.py runs the same measurement after its serving figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from radixmesh.core.hicache import DTYPE_BYTES, HostPoolSpec, KVGeometry
from radixmesh.engine.stores.page_mover import PREFETCH_AHEAD, PageMover
from radixmesh.engine.stores.storage import open_backend
from radixmesh.mesh.nats_server import EmbeddedNats, free_port, wait_for_port

BACKENDS = ("file", "redis", "nats")
NATS_BUCKET = "bench-hicache-storage"
# SmolLM2-135M's KV geometry (bench_host_copies' defaults): 22.5 KiB a token in bf16.
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


# ---- a Redis of the sitting's own -----------------------------------------------------------


class RedisServer:
    """redis-server on a free loopback port, no persistence; `url` names its db 0."""

    def __init__(self, binary: str, folder: str) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", folder],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_port("127.0.0.1", self.port, 10)
        except TimeoutError:
            self.stop()
            raise

    def flush(self) -> None:
        """Empty it: every run starts from an empty store."""
        import redis

        client = redis.Redis.from_url(self.url)
        try:
            client.flushall()
        finally:
            client.close()

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


async def _timed(fn: Callable[[], Awaitable[Any]]) -> float:
    began = time.perf_counter()
    await fn()
    return time.perf_counter() - began


async def _get_ahead(backend: Any, keys: list[str], ahead: int) -> None:
    """Gets with `ahead` in flight, in order, as PageMover.prefetch keeps them."""
    window: deque[asyncio.Task[Any]] = deque()
    for i, key in enumerate(keys):
        window.append(asyncio.ensure_future(backend.get(key)))
        while window and (len(window) == ahead or i == len(keys) - 1):
            if await window.popleft() is None:
                raise RuntimeError("a page went missing")


async def backend_throughput(name: str, config: dict[str, Any], nats_url: str,
                             args: argparse.Namespace, pages: list[bytes]) -> dict[str, float]:
    """GB/s of puts, gets (one at a time, PREFETCH_AHEAD at once), PageMover's store and
    prefetch; medians of --runs, fresh keys every run."""
    nbytes = sum(len(p) for p in pages)
    backend = await open_backend(name, config, nats_url)
    g = KVGeometry(LAYERS, KV_HEADS, HEAD_DIM, args.dtype)
    slots = len(pages) * args.page_tokens
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    seg = f"bench-hicache-storage-{os.getpid()}-{name}"
    spec = HostPoolSpec(seg, str(shm / seg), slots, "layer_first", g, name)
    with open(spec.path, "wb") as f:  # real bytes in the segment, as PageMover's store reads
        f.write(np.random.default_rng(0).integers(0, 256, spec.nbytes, dtype=np.uint8).data)
    mover = PageMover(engine_id="bench", spec=spec, backend=backend, page_tokens=args.page_tokens)
    times: dict[str, list[float]] = {k: [] for k in ("put", "get", "get_ahead", "mover_store",
                                                     "mover_prefetch")}
    try:
        page_slots = [list(range(i * args.page_tokens, (i + 1) * args.page_tokens))
                      for i in range(len(pages))]
        for _ in range(args.runs):
            keys = [os.urandom(16).hex() for _ in pages]

            async def put_all(keys: list[str] = keys) -> None:
                for key, page in zip(keys, pages, strict=True):
                    await backend.put(key, page)

            async def get_all(keys: list[str] = keys) -> None:
                for key in keys:
                    if await backend.get(key) is None:
                        raise RuntimeError(f"page {key} missing")

            times["put"].append(await _timed(put_all))
            times["get"].append(await _timed(get_all))
            times["get_ahead"].append(await _timed(lambda k=keys: _get_ahead(backend, k,
                                                                           PREFETCH_AHEAD)))
            mover_keys = [os.urandom(16).hex() for _ in pages]

            async def store(mk: list[str] = mover_keys) -> None:
                if mover.store(list(zip(mk, page_slots, strict=True))) != len(mk):
                    raise RuntimeError("PageMover dropped pages: its queue is full")
                await mover.flush(600)

            async def prefetch(mk: list[str] = mover_keys) -> None:
                steps = [n async for n in mover.prefetch(mk, [s for p in page_slots for s in p])]
                arrived = steps[-1] if steps else 0
                if arrived != len(mk):
                    raise RuntimeError(f"prefetch got {arrived} of {len(mk)} pages")

            times["mover_store"].append(await _timed(store))
            times["mover_prefetch"].append(await _timed(prefetch))
    finally:
        mover.close()
        os.unlink(spec.path)
        await backend.close()
    return {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}


def memcpy_throughput(pages: list[bytes], runs: int) -> float:
    """GB/s of copying the same pages, one by one, into a buffer of their size."""
    src = [np.frombuffer(p, dtype=np.uint8) for p in pages]
    dst = np.empty(sum(s.size for s in src), dtype=np.uint8)
    spent = []
    for _ in range(runs + 1):  # the first touches dst's pages
        began = time.perf_counter()
        at = 0
        for s in src:
            np.copyto(dst[at : at + s.size], s)
            at += s.size
        spent.append(time.perf_counter() - began)
    return dst.size / statistics.median(spent[1:]) / 1e9


def throughput(args: argparse.Namespace, sides: list[str], folder: Path,
               redis: RedisServer | None) -> dict[str, Any]:
    """Every backend of `sides` (redis only with `redis`), --pages pages, --runs runs."""
    page_bytes = args.page_tokens * KVGeometry(LAYERS, KV_HEADS, HEAD_DIM, args.dtype).token_bytes
    rng = np.random.default_rng(1)
    pages = [rng.integers(0, 256, page_bytes, dtype=np.uint8).tobytes()
             for _ in range(args.pages)]
    out: dict[str, Any] = {"page_bytes": page_bytes, "pages": args.pages, "runs": args.runs,
                           "prefetch_ahead": PREFETCH_AHEAD, "backends": {}}
    for name in (b for b in BACKENDS if b in sides):
        try:
            if name == "nats":
                with EmbeddedNats(jetstream=True) as nats:
                    rates = asyncio.run(backend_throughput(name, {"bucket": NATS_BUCKET},
                                                           nats.url, args, pages))
            elif name == "redis":
                assert redis is not None
                redis.flush()
                rates = asyncio.run(backend_throughput(name, {"url": redis.url}, "", args,
                                                       pages))
                redis.flush()
            else:
                rates = asyncio.run(backend_throughput(
                    name, {"path": str(folder / "throughput")}, "", args, pages))
        except Exception as exc:  # one backend's failure costs its row, not the sitting
            rates = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        out["backends"][name] = rates
    out["memcpy_gb_s"] = memcpy_throughput(pages, max(args.runs, 3))
    return out


def report_throughput(t: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"storage throughput, {t['pages']} pages of {t['page_bytes'] / 1e6:.2f} MB "
        f"({args.page_tokens} tokens x {LAYERS} layers x K,V x {KV_HEADS} KV heads x "
        f"{HEAD_DIM} x {DTYPE_BYTES[args.dtype]} B), GB/s, median of {t['runs']}:",
        f"  {'backend':<8}{'put':>8}{'get x1':>8}{'get x' + str(t['prefetch_ahead']):>8}"
        f"{'mover store':>13}{'mover prefetch':>16}",
    ]
    for name, r in t["backends"].items():
        if "error" in r:
            lines.append(f"  {name:<8}FAILED: {r['error']}")
            continue
        lines.append(f"  {name:<8}{r['put']:>8.2f}{r['get']:>8.2f}{r['get_ahead']:>8.2f}"
                     f"{r['mover_store']:>13.2f}{r['mover_prefetch']:>16.2f}")
    lines.append(f"  plain memcpy of the same pages: {t['memcpy_gb_s']:.2f} GB/s")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of this measurement (bench_hicache_storage.py takes them too)."""
    p.add_argument("--pages", type=int, default=32,
                   help="pages each throughput measurement moves; 0: skip it")
    p.add_argument("--page-tokens", type=int, default=64, help="tokens of a storage page")
    p.add_argument("--runs", type=int, default=3, help="throughput runs (median)")
    p.add_argument("--redis-server", default=shutil.which("redis-server"),
                   help="the redis-server binary (default: the one on PATH)")
    p.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPE_BYTES))


def has_redis(args: argparse.Namespace) -> str | None:
    """Why redis cannot run here, or None when it can."""
    if args.redis_server and os.access(args.redis_server, os.X_OK):
        return None
    return f"no redis-server binary ({args.redis_server or 'none on PATH'})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sides", default=",".join(BACKENDS),
                   help=f"comma-separated, of {', '.join(BACKENDS)}")
    add_arguments(p)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if set(sides) - set(BACKENDS) or not sides or args.pages < 1:
        p.error(f"--sides takes {', '.join(BACKENDS)} and --pages at least 1; "
                f"got {args.sides!r}, {args.pages}")
    if "redis" in sides and (why := has_redis(args)):
        print(f"skipping redis: {why}")
        sides.remove("redis")
    with tempfile.TemporaryDirectory(prefix="bench-storage-backends-") as tmp:
        redis = RedisServer(args.redis_server, tmp) if "redis" in sides else None
        try:
            figures = throughput(args, sides, Path(tmp), redis)
        finally:
            if redis is not None:
                redis.stop()
    print(report_throughput(figures, args))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "throughput": figures},
                                              indent=1) + "\n")


if __name__ == "__main__":
    main()
