"""HiCache's storage (L3) tier: the TTFT of a conversation that comes back after /flush_cache
(and after a restart) with each storage backend against recomputing it, in one sitting; and
each backend's load throughput in GB/s.

Usage:
    python benchmarks/bench_hicache_storage.py                 # 8 chats, 2 repeats, ~7 min
    python benchmarks/bench_hicache_storage.py --quick         # 3 chats, 1 repeat: a smoke run
    python benchmarks/bench_hicache_storage.py --sides recompute,file --json storage.json

Sides: recompute (the host tier alone: nothing survives a flush), file (a directory of the
sitting's own), redis (a redis-server of the sitting's own on a free port; skipped, with the
reason, when there is no redis-server binary) and nats (the mesh's own NATS with JetStream,
an object store bucket). Each side runs in a mesh of its own (the bundled model, bf16 by
default, --enable-hierarchical-cache, the storage prefetch policy of --prefetch-policy),
started fresh with an empty store for every repeat, and warmed up: two requests, their pages
written, a flush, the two again from storage, a flush.

The workload is `radixmesh bench`'s multi-turn one (radixmesh.bench.workloads, fixed seed):
--conversations chats opening with a --first-len-token message, going on with
--question-len-token ones, --output-len tokens an answer (greedy, ignore_eos), every turn
resending the conversation so far, --concurrency requests in flight (1: a clean TTFT).

    turn 1   everything computed (the host tier and storage written through)
             ... until cachectl has written every page the scheduler handed it
             (radixmesh:hicache_storage_pages_total against the scheduler's
             hicache_storage_pages_stored_total), then /flush_cache: device and host empty
    turn 2   "after a flush": the prefix comes from storage, or is recomputed
    turn 3   "after a restart", file and recompute only: the file mesh is stopped (its pages
             written first) and a new one started on the same directory; recompute flushes

The order of the sides alternates over --repeats (recompute, file, redis, nats, then back)
so that the machine's noise hits all. Figures pool every repeat: TTFT p50 and mean per turn,
their ratio to recompute's, the prompt tokens each tier served (meta_info.
cached_tokens_details) and the share from storage, the scheduler's prefetches, cachectl's
page outcomes. Last, the backends alone (radixmesh/engine/stores/storage.py's open_backend and
PageMover) on --pages pages of SmolLM2's real page (64 tokens x 30 layers x K,V x 3 KV
heads x head_dim 64 x 2 bytes = 1.47 MB in bf16): sequential puts, gets one at a time and
PREFETCH_AHEAD at once, PageMover's store (exists + put, its one writer task) and prefetch
(PREFETCH_AHEAD ahead, scattered into a host segment), beside a plain memcpy of the same bytes.
--json writes all of it, every request included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from radixmesh.bench.backends import RadixmeshBackend
from radixmesh.bench.stats import RequestResult, distribution
from radixmesh.bench.workloads import Workload, multi_turn_workload, word_pool
from radixmesh.core.hicache import DTYPE_BYTES, PREFETCH_POLICIES, HostPoolSpec, KVGeometry
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.engine.stores.page_mover import PREFETCH_AHEAD, PageMover
from radixmesh.engine.stores.storage import open_backend
from radixmesh.launcher import Mesh, MeshArgs
from radixmesh.mesh.nats_server import EmbeddedNats, free_port, wait_for_port

SIDES = ("recompute", "file", "redis", "nats")
TIERS = ("device", "host", "storage")
OUTCOMES = ("hit", "miss", "corrupt", "read_error", "written", "already_stored",
            "write_error", "dropped")
WRITE_DONE = ("written", "already_stored", "write_error", "dropped")  # a page cachectl is done with
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


def storage_of(side: str, store_dir: str, redis: RedisServer | None) -> tuple[str | None, str]:
    """The mesh's hicache_storage_backend and its extra config (JSON) for a side."""
    if side == "file":
        return "file", json.dumps({"path": store_dir})
    if side == "redis":
        assert redis is not None
        return "redis", json.dumps({"url": redis.url})
    if side == "nats":
        return "nats", json.dumps({"bucket": NATS_BUCKET})
    return None, ""


# ---- the mesh's metrics ----------------------------------------------------------------------


def scrape(mesh: Mesh, service: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a service's /metrics (service: "cachectl-0", "scheduler-0")."""
    child = next(c for c in mesh.children if c.name == service)
    url = child.health_url.removesuffix("/health") + "/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return [(s.name, s.labels, s.value)
            for family in text_string_to_metric_families(text) for s in family.samples]


def total(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples
               if n == name and all(lab.get(k) == want for k, want in labels.items()))


def storage_counters(mesh: Mesh) -> dict[str, float]:
    """cachectl's page outcomes and bytes, the scheduler's storage and prefetch counters."""
    cachectl, sched = scrape(mesh, "cachectl-0"), scrape(mesh, "scheduler-0")
    out = {f"pages_{o}": total(cachectl, "radixmesh:hicache_storage_pages_total", outcome=o)
           for o in OUTCOMES}
    for direction in ("read", "write"):
        out[f"bytes_{direction}"] = total(cachectl, "radixmesh:hicache_storage_bytes_total",
                                          direction=direction)
    out["pages_handed"] = total(sched, "radixmesh:hicache_storage_pages_stored_total")
    out["queries"] = total(sched, "radixmesh:hicache_storage_queries_total")
    for outcome in ("complete", "partial", "none"):
        out[f"prefetches_{outcome}"] = total(sched, "radixmesh:hicache_prefetches_total",
                                             outcome=outcome)
    out["prefetch_tokens"] = total(sched, "radixmesh:hicache_prefetch_tokens_total")
    out["prefetch_wait_s"] = total(sched, "radixmesh:hicache_prefetch_wait_seconds_sum")
    return out


def wait_written(mesh: Mesh, timeout: float) -> dict[str, float]:
    """Wait until cachectl is done with every page the scheduler handed it (written, already
    stored, failed or dropped) and the counts stay put: the writes have landed. The
    counters then, with the seconds until they last moved; a warning when they never
    settle."""
    began = time.perf_counter()
    last: tuple[float, float] | None = None
    settled_since = 0.0
    while True:
        c = storage_counters(mesh)
        done = sum(c[f"pages_{o}"] for o in WRITE_DONE)
        now = (c["pages_handed"], done)
        if now != last:
            last, settled_since = now, time.perf_counter()
        elif done >= c["pages_handed"] and time.perf_counter() - settled_since >= 0.6:
            break
        if time.perf_counter() - began > timeout:
            print(f"WARNING: storage writes not settled after {timeout:.0f} s: cachectl "
                  f"done with {done:.0f} of {c['pages_handed']:.0f} pages", file=sys.stderr)
            break
        time.sleep(0.2)
    c["wait_s"] = settled_since - began
    return c


# ---- one side ----------------------------------------------------------------------------


async def flush(backend: RadixmeshBackend) -> None:
    """/flush_cache, retried while a request still holds cache (it says so)."""
    for _ in range(50):
        if await backend.flush_cache():
            return
        await asyncio.sleep(0.2)
    raise RuntimeError("/flush_cache kept failing")


async def send_turn(
    backend: RadixmeshBackend, workload: Workload, histories: list[list[int]], turn: int,
    concurrency: int,
) -> list[RequestResult]:
    """Every conversation's `turn` (1-based) on top of its history, which grows by the
    turn and its answer."""
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int) -> RequestResult:
        step = workload.conversations[i].turns[turn - 1]
        prompt = histories[i] + step.new_ids
        result = RequestResult(i, turn, len(prompt), step.output_len)
        async with slots:
            done = await backend.complete(prompt, step.output_len)
        result.error, result.output_tokens = done.error, done.output_tokens
        result.prompt_tokens, result.cached_tokens = done.prompt_tokens, done.cached_tokens
        result.cached_tokens_details = done.cached_tokens_details
        result.ttft, result.latency, result.itls = done.clock.ttft, done.latency, done.clock.itls
        histories[i] = prompt + done.output_ids
        return result

    return list(await asyncio.gather(*(one(i) for i in range(len(workload.conversations)))))


async def warm_up(backend: RadixmeshBackend, mesh: Mesh, pool: list[int], args: argparse.Namespace,
                  seed: int, storage: bool) -> None:
    """Two requests of fresh words as long as turn 1's; with storage, their pages written,
    a flush and the two again (from storage); a flush. Every path the run takes, once."""
    rng = random.Random(seed)
    prompts = [rng.choices(pool, k=args.first_len) for _ in range(2)]
    for again in (False, True):
        for prompt in prompts:
            done = await backend.complete(prompt, 4)
            if done.error:
                raise RuntimeError(f"warm-up failed: {done.error}")
        if not storage:
            break
        if not again:
            await asyncio.to_thread(wait_written, mesh, args.write_timeout)
        await flush(backend)
    await flush(backend)


async def drive(mesh: Mesh, side: str, args: argparse.Namespace, workload: Workload,
                pool: list[int], histories: list[list[int]], turns: list[int],
                warm_seed: int) -> dict[str, Any]:
    """Warm up, then each turn of `turns`, from a flushed cache (the first from the warm-up's
    flush); before every flush, the storage writes have landed. Per turn: its requests and
    the storage counters it moved."""
    storage = side != "recompute"
    backend = RadixmeshBackend(mesh.url, Tokenizer.from_path(args.model_path))
    out: dict[str, Any] = {"requests": [], "counters": {}, "write_wait_s": {}, "phase_s": {}}
    try:
        began = time.perf_counter()
        await warm_up(backend, mesh, pool, args, warm_seed, storage)
        out["phase_s"]["warm-up"] = time.perf_counter() - began
        for k, turn in enumerate(turns):
            began = time.perf_counter()
            if k:
                await flush(backend)
            before = await asyncio.to_thread(storage_counters, mesh) if storage else {}
            results = await send_turn(backend, workload, histories, turn, args.concurrency)
            out["requests"] += [asdict(r) for r in results]
            if storage:  # its pages written: a flush or a stop loses none of them
                after = await asyncio.to_thread(wait_written, mesh, args.write_timeout)
                out["write_wait_s"][turn] = after.pop("wait_s")
                out["counters"][turn] = {n: v - before.get(n, 0.0) for n, v in after.items()}
            out["phase_s"][f"turn {turn}"] = time.perf_counter() - began
    finally:
        await backend.close()
    return out


def run_side(side: str, args: argparse.Namespace, workload: Workload, pool: list[int],
             folder: Path, log_dir: Path, redis: RedisServer | None) -> dict[str, Any]:
    """One run of a side: its turns 1 and 2 in a fresh mesh with an empty store; turn 3
    for file (in a second mesh on the same directory) and recompute (after a flush)."""
    if side == "redis":
        assert redis is not None
        redis.flush()
    backend, config = storage_of(side, str(folder / "pages"), redis)
    mesh_args = MeshArgs(
        model_path=args.model_path, dtype=args.dtype, port=0, grpc_port=0,
        log_dir=str(log_dir), max_total_tokens=args.max_total_tokens,
        enable_hierarchical_cache=True, hicache_ratio=args.hicache_ratio,
        hicache_storage_backend=backend, hicache_storage_backend_extra_config=config,
        hicache_storage_prefetch_policy=args.prefetch_policy,
    )
    histories: list[list[int]] = [[] for _ in workload.conversations]
    restart = args.restart and side in ("recompute", "file")
    first_turns = [1, 2, 3] if restart and side == "recompute" else [1, 2]
    began = time.perf_counter()
    run = in_mesh(mesh_args, lambda mesh: drive(mesh, side, args, workload, pool, histories,
                                                first_turns, args.seed + 101))
    if restart and side == "file":
        again = in_mesh(mesh_args, lambda mesh: drive(mesh, side, args, workload, pool,
                                                      histories, [3], args.seed + 202))
        again["phase_s"]["restart warm-up"] = again["phase_s"].pop("warm-up")
        for key in ("counters", "write_wait_s", "phase_s"):
            run[key].update(again[key])
        run["requests"] += again["requests"]
        run["mesh_s"] += again["mesh_s"]
    run["wall_s"] = time.perf_counter() - began
    return run


def in_mesh(mesh_args: MeshArgs,
            drive_it: Callable[[Mesh], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """drive_it in a mesh started for it; with how long the mesh took to start and stop."""
    began = time.perf_counter()
    mesh = Mesh(mesh_args).start(timeout=300)
    started = time.perf_counter()
    try:
        out = asyncio.run(drive_it(mesh))
    finally:
        stopping = time.perf_counter()
        mesh.stop()
    out["mesh_s"] = [{"start": started - began, "stop": time.perf_counter() - stopping}]
    return out


# ---- figures ---------------------------------------------------------------------------------


def figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's figures per turn, over all its runs."""
    results = [RequestResult(**r) for run in runs for r in run["requests"]]
    out: dict[str, Any] = {"failed": sum(not r.ok for r in results),
                           "exact_output_lengths": all(r.output_tokens == r.requested_tokens
                                                       for r in results if r.ok),
                           "turns": {}}
    for turn in sorted({r.turn for r in results}):
        done = [r for r in results if r.ok and r.turn == turn]
        ttfts = [r.ttft for r in done if r.ttft is not None]
        prompt = sum(r.prompt_tokens or r.sent_tokens for r in done)
        tiers = {t: sum((r.cached_tokens_details or {}).get(t, 0) for r in done) for t in TIERS}
        counters = [run["counters"][turn] for run in runs if turn in run["counters"]]
        summed = {k: sum(c[k] for c in counters) for k in (counters[0] if counters else {})}
        waits = [run["write_wait_s"][turn] for run in runs if turn in run["write_wait_s"]]
        out["turns"][turn] = {
            "requests": len(done),
            "ttft_ms": distribution(ttfts),
            "prompt_tokens_per_request": prompt / len(done) if done else 0.0,
            "tier_tokens_per_request": {t: n / len(done) if done else 0.0
                                        for t, n in tiers.items()},
            "storage_share": tiers["storage"] / prompt if prompt else 0.0,
            "requests_without_storage_hit": sum(
                not (r.cached_tokens_details or {}).get("storage") for r in done),
            "storage_counters": summed,  # summed over runs
            "write_wait_s": statistics.median(waits) if waits else None,
        }
    return out


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def report(args: argparse.Namespace, fig: dict[str, dict[str, Any]]) -> str:
    sides = list(fig)
    base = fig.get("recompute")
    lines = [
        f"workload: {args.conversations} conversations, a {args.first_len}-token first "
        f"message, {args.question_len}-token follow-ups, {args.output_len} output tokens, "
        f"concurrency {args.concurrency}; device pool {args.max_total_tokens} tokens, host "
        f"tier {args.hicache_ratio:g}x, storage page {args.page_tokens} tokens, prefetch "
        f"policy {args.prefetch_policy}; {args.dtype}; {args.repeats} repeat(s) a side",
    ]
    head = (f"{'':<14}{'p50 ms':>9}{'mean ms':>9}{'p50 x':>7}{'mean x':>8}"
            f"{'storage':>9}{'host':>6}{'device':>7}{'share':>7}{'no hit':>7}{'wait s':>8}")
    for turn, title in ((1, "turn 1, computed (written through to storage)"),
                        (2, "turn 2, after /flush_cache"),
                        (3, "turn 3, after a restart (recompute: after a flush)")):
        rows = [s for s in sides if turn in fig[s]["turns"]]
        if not rows:
            continue
        prompt = fig[rows[0]]["turns"][turn]["prompt_tokens_per_request"]
        lines.append(f"{title}, {prompt:.0f}-token prompts: TTFT, x recompute; prompt tokens "
                     f"a request per tier; share from storage; requests with no storage hit; "
                     f"write wait")
        lines.append(head)
        b = base["turns"].get(turn) if base else None
        for s in rows:
            t = fig[s]["turns"][turn]
            d, tiers = t["ttft_ms"] or {}, t["tier_tokens_per_request"]
            p50, mean = d.get("p50"), d.get("mean")
            bd = (b or {}).get("ttft_ms") or {}
            wait = t["write_wait_s"]
            lines.append(
                f"{s:<14}{p50 or 0:>9.0f}{mean or 0:>9.0f}{_ratio(p50, bd.get('p50')):>7}"
                f"{_ratio(mean, bd.get('mean')):>8}{tiers['storage']:>9.0f}{tiers['host']:>6.0f}"
                f"{tiers['device']:>7.0f}{t['storage_share']:>7.2f}"
                f"{t['requests_without_storage_hit'] if turn > 1 else 0:>7}"
                f"{'-' if wait is None else f'{wait:.2f}':>8}")
    lines.append("storage, per side and turn (all runs): pages written / hit / miss / errors; "
                 "prefetches complete / partial / none, mean wait")
    for s in sides:
        for turn, t in fig[s]["turns"].items():
            c = t["storage_counters"]
            if not c:
                continue
            errors = sum(c[f"pages_{o}"] for o in ("corrupt", "read_error", "write_error",
                                                   "dropped"))
            n = c["prefetches_complete"] + c["prefetches_partial"] + c["prefetches_none"]
            wait = f"{c['prefetch_wait_s'] / n * 1000:.0f} ms" if n else "-"
            lines.append(
                f"  {s:<6} turn {turn}: {c['pages_written']:.0f} / {c['pages_hit']:.0f} / "
                f"{c['pages_miss']:.0f} / {errors:.0f}; {c['prefetches_complete']:.0f} / "
                f"{c['prefetches_partial']:.0f} / {c['prefetches_none']:.0f}, {wait}")
    for s in sides:
        if fig[s]["failed"] or not fig[s]["exact_output_lengths"]:
            lines.append(f"WARNING {s}: {fig[s]['failed']} failed requests; exact output "
                         f"lengths: {fig[s]['exact_output_lengths']}")
    return "\n".join(lines)


# ---- load throughput of the backends ---------------------------------------------------------


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
    page_bytes = args.page_tokens * KVGeometry(LAYERS, KV_HEADS, HEAD_DIM, args.dtype).token_bytes
    rng = np.random.default_rng(1)
    pages = [rng.integers(0, 256, page_bytes, dtype=np.uint8).tobytes()
             for _ in range(args.pages)]
    out: dict[str, Any] = {"page_bytes": page_bytes, "pages": args.pages, "runs": args.runs,
                           "prefetch_ahead": PREFETCH_AHEAD, "backends": {}}
    for name in (s for s in SIDES[1:] if s in sides):
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


# ---- main ------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sides", default=",".join(SIDES),
                   help=f"comma-separated, of {', '.join(SIDES)}")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--first-len", type=int, default=1500, help="tokens of the first message")
    p.add_argument("--question-len", type=int, default=64, help="tokens of every later one")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-total-tokens", type=int, default=16384, help="device KV pool")
    p.add_argument("--hicache-ratio", type=float, default=2.0)
    p.add_argument("--prefetch-policy", choices=PREFETCH_POLICIES, default="timeout")
    p.add_argument("--no-restart", dest="restart", action="store_false",
                   help="skip turn 3 (the file mesh restarted)")
    p.add_argument("--repeats", type=int, default=2, help="runs a side, alternating order")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 1 repeat, 3 conversations, 8 pages, 2 runs")
    p.add_argument("--pages", type=int, default=32,
                   help="pages each throughput measurement moves; 0: skip it")
    p.add_argument("--page-tokens", type=int, default=64, help="tokens of a storage page")
    p.add_argument("--runs", type=int, default=3, help="throughput runs (median)")
    p.add_argument("--write-timeout", type=float, default=120.0,
                   help="seconds to wait for the storage writes to land")
    p.add_argument("--redis-server", default=shutil.which("redis-server"),
                   help="the redis-server binary (default: the one on PATH)")
    p.add_argument("--model-path", help="default: the bundled SmolLM2-135M-Instruct GGUF")
    p.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPE_BYTES))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-dir", help="keep the services' logs here (default: discarded)")
    p.add_argument("--json", help="write the figures, every run and request here")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.conversations, args.pages, args.runs = 1, 3, 8, 2
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = set(sides) - set(SIDES)
    if unknown or not sides:
        p.error(f"--sides takes {', '.join(SIDES)}; got {args.sides!r}")
    skipped: dict[str, str] = {}
    if "redis" in sides and not (args.redis_server and os.access(args.redis_server, os.X_OK)):
        skipped["redis"] = f"no redis-server binary ({args.redis_server or 'none on PATH'})"
        sides.remove("redis")
        print(f"skipping redis: {skipped['redis']}")

    began = time.perf_counter()
    tokenizer = Tokenizer.from_path(args.model_path)
    pool = word_pool(tokenizer)
    workload = multi_turn_workload(pool, args.seed, args.conversations, 3, args.first_len,
                                   args.question_len, args.output_len)
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="bench-hicache-storage-") as tmp:
        redis = RedisServer(args.redis_server, tmp) if "redis" in sides else None
        try:
            for r in range(args.repeats):
                for side in sides if r % 2 == 0 else sides[::-1]:
                    name = f"{side}-{r + 1}"
                    log_dir = Path(args.log_dir or tmp) / name / "logs"
                    run = run_side(side, args, workload, pool, Path(tmp) / name, log_dir, redis)
                    runs[side].append(run)
                    ttft = {t: statistics.median(
                        x["ttft"] for x in run["requests"] if x["turn"] == t and x["ttft"])
                        for t in sorted({x["turn"] for x in run["requests"]})}
                    spent = [*(f"mesh start {m['start']:.0f}, stop {m['stop']:.0f}"
                               for m in run["mesh_s"]),
                             *(f"{k} {v:.0f}" for k, v in run["phase_s"].items())]
                    print(f"repeat {r + 1} {side}: {run['wall_s']:.0f} s ({', '.join(spent)});"
                          " TTFT p50 "
                          + ", ".join(f"turn {t} {v * 1000:.0f} ms" for t, v in ttft.items()),
                          file=sys.stderr, flush=True)
            fig = {side: figures(runs[side]) for side in sides}
            print(report(args, fig))
            copies = throughput(args, sides, Path(tmp), redis) if args.pages > 0 else None
            if copies:
                print(report_throughput(copies, args))
        finally:
            if redis is not None:
                redis.stop()
    wall = time.perf_counter() - began
    print(f"wall time: {wall:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": vars(args), "skipped": skipped, "figures": fig, "throughput": copies,
             "wall_s": wall, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
