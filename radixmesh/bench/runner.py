"""Drive a workload against a backend: arrivals, a concurrency bound, turns in order."""

from __future__ import annotations

import asyncio
import math
import random
import time
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from radixmesh.bench.backends import Backend
from radixmesh.bench.stats import RequestResult, summarize
from radixmesh.bench.workloads import Conversation, Turn, Workload


@dataclass(frozen=True)
class Load:
    """How requests arrive: at most max_concurrency in flight, conversations at a rate."""

    max_concurrency: int | None = None  # None: no bound
    request_rate: float = math.inf  # conversations started per second (Poisson); inf: at once
    seed: int = 0


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Start times (s from the run's start) of n arrivals: a Poisson process at `rate`."""
    if rate <= 0:
        raise ValueError(f"request_rate must be positive, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        offsets.append(t)
    return offsets


@dataclass
class RunResult:
    """Every request of one run and how long the run took."""

    results: list[RequestResult]
    duration: float


async def _conversation(
    backend: Backend, index: int, conversation: Conversation, slots: AbstractAsyncContextManager,
    bar: tqdm,
) -> list[RequestResult]:
    history: list[int] = []
    results: list[RequestResult] = []
    failed = False
    for number, turn in enumerate(conversation.turns, start=1):
        prompt = history + turn.new_ids
        result = RequestResult(index, number, len(prompt), turn.output_len)
        results.append(result)
        if failed:
            result.error = "an earlier turn failed"
        else:
            async with slots:
                done = await backend.complete(prompt, turn.output_len)
            result.error = done.error
            result.output_tokens = done.output_tokens
            result.prompt_tokens = done.prompt_tokens
            result.cached_tokens = done.cached_tokens
            result.cached_tokens_details = done.cached_tokens_details
            result.ttft = done.clock.ttft
            result.latency = done.latency
            result.itls = done.clock.itls
            failed = not result.ok
            history = prompt + done.output_ids
        bar.update(1)
    return results


async def run_workload(
    backend: Backend, workload: Workload, load: Load, progress: bool = True
) -> RunResult:
    """Run every conversation of the workload under `load`; turns of one run in order."""
    slots: AbstractAsyncContextManager = (
        asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else nullcontext()
    )
    offsets = arrival_offsets(len(workload.conversations), load.request_rate, load.seed)
    label = f"{workload.name} c={load.max_concurrency or 'inf'}"
    with tqdm(total=workload.num_requests, desc=label, unit="req", disable=not progress,
              leave=False) as bar:
        started = time.perf_counter()

        async def start(i: int, conversation: Conversation) -> list[RequestResult]:
            await asyncio.sleep(max(0.0, started + offsets[i] - time.perf_counter()))
            return await _conversation(backend, i, conversation, slots, bar)

        per_conversation = await asyncio.gather(
            *(start(i, c) for i, c in enumerate(workload.conversations))
        )
        duration = time.perf_counter() - started
    return RunResult([r for rs in per_conversation for r in rs], duration)


def warmup_workload(workload: Workload, pool: list[int], requests: int, seed: int) -> Workload:
    """Prompts as long as the workload's first turns, of fresh tokens that share nothing."""
    rng = random.Random(seed + 7919)
    firsts = [c.turns[0] for c in workload.conversations]
    turns = [firsts[i % len(firsts)] for i in range(requests)]
    convs = [Conversation([Turn(rng.choices(pool, k=len(t.new_ids)), min(t.output_len, 8))])
             for t in turns]
    return Workload("warm-up", convs)


async def warm_up(
    backend: Backend, workload: Workload, pool: list[int], requests: int, seed: int
) -> None:
    """Run a few requests shaped like the workload's first ones, then flush the prefix cache."""
    if requests < 1 or not workload.conversations:
        return
    warm = warmup_workload(workload, pool, requests, seed)
    run = await run_workload(backend, warm, Load(), progress=False)
    failed = [r.error for r in run.results if not r.ok]
    if failed:
        raise RuntimeError(f"warm-up failed: {failed[0]}")
    await backend.flush_cache()


async def run_loads(
    backend: Backend, workload: Workload, loads: list[Load], pool: list[int],
    warmup_requests: int = 2, progress: bool = True,
) -> list[dict[str, Any]]:
    """Warm up, then run the workload once per load from a flushed cache; the summaries."""
    await warm_up(backend, workload, pool, warmup_requests, loads[0].seed if loads else 0)
    runs = []
    for load in loads:
        await backend.flush_cache()
        run = await run_workload(backend, workload, load, progress)
        rate = None if math.isinf(load.request_rate) else load.request_rate
        runs.append({"workload": workload.name, "max_concurrency": load.max_concurrency,
                     "request_rate": rate, **summarize(run.results, run.duration)})
    return runs
