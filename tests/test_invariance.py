"""A request's greedy output must not depend on how it was run (float32, the real model):
alone, batched with others, chunked, from a cached prefix, with pages, with or without overlap."""

from __future__ import annotations

import random

import pytest

from radixmesh.api import Engine

GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
WORDS = [
    "river",
    "stone",
    "quietly",
    "garden",
    "because",
    "maybe",
    "seven",
    "orange",
    "window",
    "travel",
    "music",
    "paper",
    "between",
    "under",
    "forest",
    "winter",
    "morning",
    "simple",
    "answer",
    "number",
    "question",
    "story",
    "light",
]


def text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


TARGET = "Summarize the following notes. " + text(90, seed=0)
OTHERS = [
    text(n, seed=i + 1)
    for i, n in enumerate([3, 17, 40, 5, 120, 9, 64, 30, 2, 77, 12, 50, 8, 99, 21])
]


@pytest.fixture(scope="module")
def reference() -> list[int]:
    with Engine(dtype="float32", max_total_tokens=8192, show_progress=False) as engine:
        return engine.generate(TARGET, GREEDY)["output_ids"]


def check_all_ways(engine: Engine, reference: list[int]) -> None:
    assert engine.generate(TARGET, GREEDY)["output_ids"] == reference, "alone"
    engine.flush_cache()
    batch = engine.generate([*OTHERS[:7], TARGET, *OTHERS[7:]], GREEDY)
    assert batch[7]["output_ids"] == reference, "in a batch of 16"
    assert batch[7]["meta_info"]["cached_tokens"] == 0
    again = engine.generate(TARGET, GREEDY)
    assert again["meta_info"]["cached_tokens"] > 0
    assert again["output_ids"] == reference, "from a cached prefix"
    engine.flush_cache()
    prefix_only = TARGET[: len(TARGET) // 2]
    engine.generate(prefix_only, {"max_new_tokens": 1})
    partial = engine.generate(TARGET, GREEDY)
    assert 0 < partial["meta_info"]["cached_tokens"] < partial["meta_info"]["prompt_tokens"] - 1
    assert partial["output_ids"] == reference, "from a partly cached prefix"


@pytest.mark.parametrize(
    "settings",
    [
        {"disable_overlap_schedule": False},
        {"disable_overlap_schedule": True, "chunked_prefill_size": 64},
        {"disable_overlap_schedule": False, "chunked_prefill_size": 64, "page_size": 16},
        {"speculative_algorithm": "NGRAM"},
        {"speculative_algorithm": "NGRAM", "disable_overlap_schedule": True,
         "chunked_prefill_size": 64, "page_size": 4},
    ],
    ids=["overlap", "no-overlap-chunk64", "overlap-chunk64-page16", "ngram",
         "ngram-no-overlap-chunk64-page4"],
)
def test_greedy_output_is_invariant(reference: list[int], settings: dict) -> None:
    with Engine(dtype="float32", max_total_tokens=8192, show_progress=False, **settings) as engine:
        check_all_ways(engine, reference)
        info = engine.server_info()
        assert info["held_slots"] == 0
        assert info["free_slots"] + info["cached_tokens"] == info["num_slots"]
        if "speculative_algorithm" in settings:  # the drafts were verified, and some taken
            assert info["spec_verify_steps"] > 0 and info["spec_accepted_tokens"] > 0
