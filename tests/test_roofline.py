"""The serving roofline's arithmetic: which tokens a perfect prefix cache still prefills, and
a workload's least time from the machine's ceilings."""

from __future__ import annotations

import math

import pytest

from radixmesh.bench.roofline import Ceilings, ModelCost, least_time, prefill_positions
from radixmesh.bench.workloads import Conversation, Turn, Workload
from radixmesh.engine.model.model_config import ModelConfig


def one_turn(*prompts: tuple[list[int], int]) -> Workload:
    return Workload("w", [Conversation([Turn(ids, out)]) for ids, out in prompts])


def test_shared_prompt_tokens_are_prefilled_once():
    work = one_turn(([1, 2, 3, 4], 3), ([1, 2, 5], 2), ([1, 2, 3, 4], 1), ([9], 1))
    # [1, 2, 3, 4] whole, then only 5 (after the shared 1, 2), nothing of the repeat, and 9.
    assert prefill_positions(work) == [0, 1, 2, 3, 2, 0]


def test_later_turns_follow_their_own_answers():
    first = Turn([1, 2], 3)
    work = Workload("w", [Conversation([first, Turn([7, 8], 2)]), Conversation([first])])
    # The second turn starts after 2 prompt and 3 answer tokens; the other conversation's
    # identical first turn costs nothing.
    assert prefill_positions(work) == [0, 1, 5, 6]


def test_least_time_from_the_ceilings():
    cost = ModelCost(layer_flops=100.0, head_flops=10.0, pair_flops=1.0, weight_bytes=1000.0,
                     kv_bytes=2.0)
    work = one_turn(([1, 2, 3], 3), ([1, 2, 4], 3), ([5], 2))
    bound = least_time(work, cost, Ceilings({"a": 1e3, "b": 2e3}, read_bytes=1e4),
                       concurrency=2)
    # Prefill: positions 0, 1, 2, 2, 0 (keys 1, 2, 3, 3, 1) and three first tokens.
    assert bound.prefill_tokens == 5
    assert bound.prefill_flops == 5 * 100 + 3 * 10 + 10 * 1
    assert bound.prefill_s == pytest.approx(540 / 2e3)
    # Decode: 2 + 2 + 1 tokens over keys 4, 5 | 4, 5 | 2, in ceil(5 / 2) steps.
    assert (bound.decode_tokens, bound.decode_steps) == (5, 3)
    assert bound.decode_flops == 5 * 110 + 20
    assert bound.decode_bytes == 3 * 1000 + 20 * 2
    assert bound.decode_s == pytest.approx(max(3040 / 1e4, 570 / 2e3))
    assert bound.total_s == pytest.approx(bound.prefill_s + bound.decode_s)
    assert bound.share(2 * bound.total_s) == pytest.approx(0.5)


def test_the_bundled_model_costs_a_quarter_gigaflop_a_token():
    config = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                         head_dim=64)
    cost = ModelCost.of(config, weight_bytes=1e8)
    assert cost.layer_flops == 2 * 30 * (576 * 960 + 576 * 576 + 3 * 576 * 1536)
    assert math.isclose((cost.layer_flops + cost.head_flops) / 1e9, 0.269, rel_tol=0.01)
    assert cost.pair_flops == 4 * 64 * 9 * 30
    assert cost.kv_bytes == 2 * 192 * 30 * 2
