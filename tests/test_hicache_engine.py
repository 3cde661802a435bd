"""The host KV tier in the in-process engine, on the real model (float32): a conversation
pushed out of a small device pool comes back from host memory, with the same output."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from radixmesh import Engine

PROMPT_TOKENS = 1000
GREEDY = {"max_new_tokens": 8, "temperature": 0}


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 30000) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


@pytest.fixture(scope="module", params=["write_through", "write_back"])
def engine(request) -> Iterator[Engine]:
    with Engine(
        dtype="float32",
        max_total_tokens=2048,
        enable_hierarchical_cache=True,
        hicache_ratio=8,
        hicache_write_policy=request.param,
        show_progress=False,
    ) as e:
        yield e


def test_an_evicted_conversation_comes_back_from_the_host_tier(engine):
    first, *others = prompts(8)
    answer = engine.generate(input_ids=first, sampling_params=GREEDY)
    assert answer["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 0}
    for ids in others:  # 7 more conversations: the 2048-slot device pool keeps at most two
        engine.generate(input_ids=ids, sampling_params=GREEDY)
    again = engine.generate(input_ids=first, sampling_params=GREEDY)
    details = again["meta_info"]["cached_tokens_details"]
    assert details["host"] >= 0.9 * PROMPT_TOKENS
    assert again["meta_info"]["cached_tokens"] == details["device"] + details["host"]
    assert again["output_ids"] == answer["output_ids"]
    info = engine.server_info()
    assert info["host_slots"] == 8 * 2048
    assert info["host_load_tokens"] == details["host"]
    engine.loop.apply(lambda sched: sched.check_invariants())  # no slot leaks, both tiers
    assert engine.flush_cache()
    emptied = engine.server_info()
    assert emptied["cached_tokens"] == 0 and emptied["host_cached_tokens"] == 0
    assert emptied["host_free_slots"] == emptied["host_slots"]
