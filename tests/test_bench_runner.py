"""The benchmark runner against an in-memory backend: turn order, concurrency, failures."""

from __future__ import annotations

import asyncio
import math
import statistics
import time

import pytest

from radixmesh.bench.backends import Backend, Completion
from radixmesh.bench.runner import (
    Load,
    arrival_offsets,
    run_loads,
    run_workload,
    warmup_workload,
)
from radixmesh.bench.streams import StreamError, TokenClock
from radixmesh.bench.workloads import multi_turn_workload, random_workload

POOL = list(range(1000, 3000))


class FakeBackend(Backend):
    """Answers each prompt with output_len copies of its length; fails prompts it is told to."""

    name = "fake"

    def __init__(self, fail_lengths: frozenset[int] = frozenset()) -> None:
        super().__init__("http://unused", tokenizer=None)  # type: ignore[arg-type]
        self.fail_lengths = fail_lengths
        self.prompts: list[list[int]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.flushes = 0

    async def flush_cache(self) -> bool:
        self.flushes += 1
        return True

    async def _stream(self, prompt: list[int], output_len: int, clock: TokenClock) -> Completion:
        self.prompts.append(prompt)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            for n in range(1, output_len + 1):
                await asyncio.sleep(0)  # let other requests run between tokens
                clock.observe(time.perf_counter(), n)
            if len(prompt) in self.fail_lengths:
                raise StreamError("HTTP 400: too long")
        finally:
            self.in_flight -= 1
        return Completion(clock, output_tokens=output_len, output_ids=[len(prompt)] * output_len,
                          prompt_tokens=len(prompt), cached_tokens=0,
                          cached_tokens_details={"device": 0, "host": len(prompt)})


def test_arrival_offsets():
    assert arrival_offsets(3, math.inf, 0) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets(2000, 4.0, seed=1)
    assert offsets == arrival_offsets(2000, 4.0, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.1)
    with pytest.raises(ValueError):
        arrival_offsets(1, 0.0, 0)


def test_turns_resend_the_conversation_with_its_answers():
    w = multi_turn_workload(POOL, 0, num_conversations=3, num_turns=3, first_len=10,
                            question_len=2, output_len=4)
    backend = FakeBackend()
    run = asyncio.run(run_workload(backend, w, Load(max_concurrency=2), progress=False))
    assert len(run.results) == 9 and all(r.ok for r in run.results)
    assert backend.max_in_flight == 2
    for i, conv in enumerate(w.conversations):
        t1, t2, t3 = conv.turns
        turn2 = t1.new_ids + [10] * 4 + t2.new_ids
        turn3 = turn2 + [len(turn2)] * 4 + t3.new_ids
        assert t1.new_ids in backend.prompts and turn2 in backend.prompts
        assert turn3 in backend.prompts
        mine = sorted((r for r in run.results if r.conversation == i), key=lambda r: r.turn)
        assert [r.sent_tokens for r in mine] == [10, 16, 22]
        assert [r.cached_tokens_details for r in mine] == [{"device": 0, "host": n}
                                                           for n in (10, 16, 22)]
        assert all(r.ttft is not None and len(r.itls) == 3 for r in mine)


def test_unbounded_concurrency_sends_everything_at_once():
    w = random_workload(POOL, 0, num_prompts=6, input_len=5, output_len=3)
    backend = FakeBackend()
    asyncio.run(run_workload(backend, w, Load(), progress=False))
    assert backend.max_in_flight == 6


def test_a_failed_turn_ends_its_conversation():
    w = multi_turn_workload(POOL, 0, num_conversations=2, num_turns=3, first_len=10,
                            question_len=2, output_len=4)
    backend = FakeBackend(fail_lengths=frozenset({16}))  # every second turn
    run = asyncio.run(run_workload(backend, w, Load(max_concurrency=1), progress=False))
    errors = sorted((r.conversation, r.turn, r.error) for r in run.results if not r.ok)
    assert errors == [(0, 2, "StreamError: HTTP 400: too long"), (0, 3, "an earlier turn failed"),
                      (1, 2, "StreamError: HTTP 400: too long"), (1, 3, "an earlier turn failed")]
    assert len(backend.prompts) == 4


def test_run_loads_warms_up_flushes_and_sweeps():
    w = random_workload(POOL, 0, num_prompts=4, input_len=5, output_len=3)
    backend = FakeBackend()
    loads = [Load(1), Load(4, request_rate=1000.0)]
    runs = asyncio.run(run_loads(backend, w, loads, POOL, warmup_requests=2, progress=False))
    assert len(backend.prompts) == 2 + 4 + 4
    assert backend.flushes == 3  # after the warm-up and before each run
    assert [(r["max_concurrency"], r["request_rate"]) for r in runs] == [(1, None), (4, 1000.0)]
    assert all(r["completed"] == 4 and r["exact_output_lengths"] for r in runs)
    assert runs[0]["cache_hit_rate"] == 0.0


def test_warmup_prompts_are_shaped_like_the_workload_but_fresh():
    w = multi_turn_workload(POOL, 0, num_conversations=2, num_turns=2, first_len=30,
                            question_len=2, output_len=20)
    warm = warmup_workload(w, POOL, requests=3, seed=0)
    firsts = [c.turns[0].new_ids for c in w.conversations]
    assert [len(c.turns) for c in warm.conversations] == [1, 1, 1]
    assert [len(c.turns[0].new_ids) for c in warm.conversations] == [30, 30, 30]
    assert all(c.turns[0].output_len == 8 for c in warm.conversations)
    assert not any(c.turns[0].new_ids in firsts for c in warm.conversations)
