"""The benchmark's workload generators, on a synthetic pool and on the real tokenizer."""

from __future__ import annotations

import pytest

from radixmesh.bench.workloads import (
    multi_turn_workload,
    random_workload,
    shared_prefix_workload,
    word_pool,
)

POOL = list(range(1000, 3000))


def test_random_workload_exact_lengths_and_seeded():
    w = random_workload(POOL, seed=3, num_prompts=5, input_len=40, output_len=7)
    assert w.name == "random" and w.num_requests == 5 and w.num_turns == 1
    turns = [c.turns[0] for c in w.conversations]
    assert [len(t.new_ids) for t in turns] == [40] * 5
    assert [t.output_len for t in turns] == [7] * 5
    assert all(set(t.new_ids) <= set(POOL) for t in turns)
    again = random_workload(POOL, seed=3, num_prompts=5, input_len=40, output_len=7)
    assert again.conversations == w.conversations
    other = random_workload(POOL, seed=4, num_prompts=5, input_len=40, output_len=7)
    assert other.conversations != w.conversations


def test_random_workload_range_ratio_bounds():
    w = random_workload(POOL, seed=1, num_prompts=200, input_len=100, output_len=10,
                        range_ratio=0.5)
    ins = [len(c.turns[0].new_ids) for c in w.conversations]
    outs = [c.turns[0].output_len for c in w.conversations]
    assert min(ins) >= 50 and max(ins) <= 100 and len(set(ins)) > 10
    assert min(outs) >= 5 and max(outs) <= 10
    with pytest.raises(ValueError, match="range_ratio"):
        random_workload(POOL, 1, 2, 10, 10, range_ratio=1.5)


def test_shared_prefix_groups_share_exactly_the_system_prompt():
    w = shared_prefix_workload(POOL, seed=2, num_groups=3, prompts_per_group=4,
                               system_prompt_len=50, question_len=6, output_len=9)
    prompts = [c.turns[0].new_ids for c in w.conversations]
    assert w.num_requests == 12
    assert all(len(p) == 56 for p in prompts)
    systems: dict[tuple[int, ...], int] = {}
    for p in prompts:
        systems[tuple(p[:50])] = systems.get(tuple(p[:50]), 0) + 1
    assert sorted(systems.values()) == [4, 4, 4]
    # Shuffled: the first four prompts do not all come from one group.
    assert len({tuple(p[:50]) for p in prompts[:4]}) > 1
    assert w.params["system_prompt_len"] == 50


def test_multi_turn_first_message_long_then_questions():
    w = multi_turn_workload(POOL, seed=5, num_conversations=3, num_turns=4, first_len=30,
                            question_len=5, output_len=4)
    assert w.num_requests == 12 and w.num_turns == 4
    for c in w.conversations:
        assert [len(t.new_ids) for t in c.turns] == [30, 5, 5, 5]
        assert [t.output_len for t in c.turns] == [4] * 4
    firsts = {tuple(c.turns[0].new_ids) for c in w.conversations}
    assert len(firsts) == 3


@pytest.mark.parametrize("bad", [{"num_prompts": 0}, {"input_len": 0}, {"output_len": -1}])
def test_lengths_must_be_positive(bad):
    args = {"num_prompts": 2, "input_len": 4, "output_len": 4} | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        random_workload(POOL, 0, **args)


def test_word_pool_prompts_round_trip_through_text():
    from radixmesh.core.tokenizer import Tokenizer

    tok = Tokenizer.from_path(None)
    pool = word_pool(tok)
    assert len(pool) > 5000
    w = random_workload(pool, seed=9, num_prompts=4, input_len=300, output_len=1)
    for c in w.conversations:
        ids = c.turns[0].new_ids
        assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
