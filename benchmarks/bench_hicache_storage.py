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
page outcomes. Last, the backends alone on --pages pages (bench_storage_backends.py's
measurement: puts, gets, PageMover's store and prefetch in GB/s beside a plain memcpy).
--json writes all of it, every request included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

# this script's folder is on sys.path
from bench_storage_backends import (
    NATS_BUCKET,
    RedisServer,
    add_arguments,
    has_redis,
    report_throughput,
    throughput,
)
from prometheus_client.parser import text_string_to_metric_families

from radixmesh.bench.backends import RadixmeshBackend
from radixmesh.bench.stats import RequestResult, distribution
from radixmesh.bench.workloads import Workload, multi_turn_workload, word_pool
from radixmesh.core.hicache import PREFETCH_POLICIES
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.launcher import Mesh, MeshArgs

SIDES = ("recompute", "file", "redis", "nats")
TIERS = ("device", "host", "storage")
OUTCOMES = ("hit", "miss", "corrupt", "read_error", "written", "already_stored",
            "write_error", "dropped")
WRITE_DONE = ("written", "already_stored", "write_error", "dropped")  # a page cachectl is done with


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
    add_arguments(p)
    p.add_argument("--write-timeout", type=float, default=120.0,
                   help="seconds to wait for the storage writes to land")
    p.add_argument("--model-path", help="default: the bundled SmolLM2-135M-Instruct GGUF")
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
    if "redis" in sides and (why := has_redis(args)):
        skipped["redis"] = why
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
