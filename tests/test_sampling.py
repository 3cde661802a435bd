"""SamplingParams validation and the batched sampler's behaviour."""

import math
import re
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from radixmesh.core.sampling_params import SamplingParams
from radixmesh.engine.model.sampling import RequestSampler, sample

# ---------------------------------------------------------------- SamplingParams


def test_from_dict_defaults():
    p = SamplingParams.from_dict({})
    assert p == SamplingParams()
    assert (p.max_new_tokens, p.min_new_tokens) == (128, 0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, -1, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.stop, p.stop_token_ids) == ([], [])
    assert (p.ignore_eos, p.skip_special_tokens, p.no_stop_trim, p.seed) == (
        False,
        True,
        False,
        None,
    )
    assert not p.is_greedy


def test_from_dict_reads_every_field():
    d = {
        "max_new_tokens": 7,
        "min_new_tokens": 2,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "frequency_penalty": 0.1,
        "presence_penalty": -0.2,
        "repetition_penalty": 1.1,
        "stop": ["\n\n", "END"],
        "stop_token_ids": [5, 6],
        "ignore_eos": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "no_stop_trim": True,
        "logit_bias": {5: 1.5},
        "seed": 42,
    }
    p = SamplingParams.from_dict(d)
    for key, value in d.items():
        assert getattr(p, key) == value


def test_from_dict_accepts_integers_for_numbers():
    p = SamplingParams.from_dict({"temperature": 1, "top_p": 1, "repetition_penalty": 2})
    assert p == SamplingParams(temperature=1.0, top_p=1.0, repetition_penalty=2.0)
    assert isinstance(p.temperature, float)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", -1),
        ("min_new_tokens", -1),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("presence_penalty", 3.0),
        ("presence_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
    ],
)
def test_out_of_range_value_names_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"{field}.*{re.escape(repr(value))}"):
        SamplingParams.from_dict({field: value})


def test_min_new_tokens_above_max_rejected():
    with pytest.raises(ValueError, match="min_new_tokens.*5"):
        SamplingParams.from_dict({"max_new_tokens": 4, "min_new_tokens": 5})


@pytest.mark.parametrize("top_k", [-1, 0, 1, 50])
def test_top_k_accepted_values(top_k):
    assert SamplingParams.from_dict({"top_k": top_k}).top_k == top_k


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "hot"),
        ("temperature", None),
        ("temperature", float("nan")),
        ("top_p", float("inf")),
        ("top_p", True),
        ("max_new_tokens", 1.5),
        ("max_new_tokens", "10"),
        ("top_k", True),
        ("ignore_eos", "yes"),
        ("skip_special_tokens", 1),
        ("seed", "abc"),
        ("seed", 1.0),
        ("stop_token_ids", 5),
        ("stop_token_ids", [1, "2"]),
        ("stop_token_ids", [1.0]),
    ],
)
def test_wrong_type_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})


def test_number_type_message():
    with pytest.raises(ValueError, match="temperature must be a number"):
        SamplingParams.from_dict({"temperature": "hot"})


def test_unknown_key_rejected_by_name():
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5})


def test_stop_string_becomes_list():
    assert SamplingParams.from_dict({"stop": "###"}).stop == ["###"]
    assert SamplingParams.from_dict({"stop": ["a", "b"]}).stop == ["a", "b"]
    assert SamplingParams.from_dict({"stop": None}).stop == []
    assert SamplingParams.from_dict({"stop_token_ids": None}).stop_token_ids == []


def test_from_dict_needs_a_dict():
    with pytest.raises(ValueError, match="dict"):
        SamplingParams.from_dict([("temperature", 0.5)])


@pytest.mark.parametrize("stop", [3, ["a", 3], [None], {"a": 1}, [""]])
def test_bad_stop_rejected(stop):
    with pytest.raises(ValueError, match="stop"):
        SamplingParams.from_dict({"stop": stop})


def test_direct_construction_is_validated():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_stop_token_ids_checked_against_vocab():
    p = SamplingParams(stop_token_ids=[3, 10])
    p.validate()
    p.validate(vocab_size=11)
    with pytest.raises(ValueError, match="stop_token_ids.*10"):
        p.validate(vocab_size=10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        RequestSampler(p, [], vocab_size=10, seed=0)
    with pytest.raises(ValueError, match="stop_token_ids.*-1"):
        SamplingParams(stop_token_ids=[-1])


def test_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert SamplingParams(temperature=0.0, top_p=0.5, min_p=0.3).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy
    assert not SamplingParams(top_k=2).is_greedy


# ---------------------------------------------------------------- helpers


def make(
    vocab: int, seed: int = 0, prompt: Sequence[int] = (), eos: Sequence[int] = (), **params
) -> RequestSampler:
    return RequestSampler(SamplingParams(**params), list(prompt), vocab, seed, eos)


def draw(logits: torch.Tensor, req: RequestSampler, **kw) -> int:
    return sample(logits[None], [req], **kw).token_ids[0]


def seeded_counts(logits: torch.Tensor, n: int, **params) -> Counter[int]:
    """Tokens drawn for seeds 0..n-1 at num_output 0, all in one batch."""
    reqs = [make(logits.shape[0], seed=s, **params) for s in range(n)]
    return Counter(sample(logits.expand(n, -1), reqs).token_ids)


def probs_logits(probs: Sequence[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def assert_matches(counts: Counter[int], expected: Sequence[float], n: int, tol: float):
    for token, p in enumerate(expected):
        assert abs(counts[token] / n - p) < tol, (token, counts[token] / n, p)


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax():
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(1))
    reqs = [make(500, seed=s, temperature=0.0) for s in range(6)]
    assert sample(logits, reqs).token_ids == logits.argmax(-1).tolist()


def test_greedy_ties_take_first_max():
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0])
    assert draw(logits, make(4, temperature=0.0)) == 1


def test_top_k_one_is_greedy_whatever_the_seed():
    logits = torch.tensor([1.0, 1.2, 0.9, 1.1])
    assert {draw(logits, make(4, seed=s, top_k=1)) for s in range(50)} == {1}


def test_temperature_zero_ignores_filters():
    logits = torch.tensor([0.0, 0.5, 0.4, 0.45])
    for s in range(20):
        req = make(4, seed=s, temperature=0.0, top_p=0.1, top_k=3, min_p=0.9)
        assert draw(logits, req) == 1


# ---------------------------------------------------------------- seeded draws

MIXED_PARAMS = [
    {},
    {"temperature": 0.7},
    {"top_p": 0.9, "temperature": 0.8},
    {"top_k": 20},
    {"min_p": 0.1},
    {"top_k": 50, "top_p": 0.95, "min_p": 0.02},
    {"temperature": 0.0},
    {"frequency_penalty": 0.5, "repetition_penalty": 1.2},
    {"top_p": 0.99},  # wide nucleus on flat logits: more tokens than the fast path reads
]


@pytest.mark.parametrize("params", MIXED_PARAMS)
def test_same_seed_same_token_alone_or_in_batch(params):
    vocab, rows = 4096, 16
    gen = torch.Generator().manual_seed(7)
    for step in range(3):
        logits = torch.randn(rows, vocab, generator=gen) * (0.5 + step)
        others = [MIXED_PARAMS[(i + step) % len(MIXED_PARAMS)] for i in range(rows)]
        batch = [make(vocab, seed=100 + i, prompt=[1, 2, 3], **others[i]) for i in range(rows)]
        batch[7] = make(vocab, seed=5, prompt=[1, 2, 3], **params)
        alone = make(vocab, seed=5, prompt=[1, 2, 3], **params)
        for r in (*batch, alone):
            for t in range(step):
                r.record(t)
        together = sample(logits, batch)
        single = sample(logits[7:8].clone(), [alone])
        assert together.token_ids[7] == single.token_ids[0]
        assert together.logprobs[7] == pytest.approx(single.logprobs[0], abs=1e-6)


def test_different_seeds_give_different_draws():
    logits = torch.zeros(100)
    counts = seeded_counts(logits, 200)
    assert len(counts) > 50


def test_draw_depends_on_num_output():
    logits = torch.zeros(100)
    req = make(100, seed=3)
    tokens = []
    for _ in range(60):
        tokens.append(draw(logits, req))
        req.record(tokens[-1])
    assert len(set(tokens)) > 30
    replay = make(100, seed=3)
    for t in tokens:
        assert draw(logits, replay) == t
        replay.record(t)


def test_sample_does_not_record():
    req = make(10, frequency_penalty=1.0)
    sample(torch.zeros(1, 10), [req])
    assert req.num_output == 0


def test_empirical_distribution_matches_softmax():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, -3.0, 0.2])
    n, temperature = 4000, 0.7
    counts = seeded_counts(logits, n, temperature=temperature)
    assert_matches(counts, torch.softmax(logits / temperature, -1).tolist(), n, tol=0.03)


def test_top_k_keeps_only_the_top_k():
    logits = probs_logits([0.1, 0.4, 0.05, 0.3, 0.15])
    n = 3000
    counts = seeded_counts(logits, n, top_k=2)
    assert set(counts) == {1, 3}
    assert_matches(counts, [0, 4 / 7, 0, 3 / 7, 0], n, tol=0.04)


def test_top_p_excludes_the_tail():
    logits = probs_logits([0.5, 0.3, 0.15, 0.05])
    n = 3000
    counts = seeded_counts(logits, n, top_p=0.75)
    assert set(counts) == {0, 1}
    assert_matches(counts, [0.5 / 0.8, 0.3 / 0.8, 0, 0], n, tol=0.04)
    assert set(seeded_counts(logits, n, top_p=0.85)) == {0, 1, 2}


def test_top_p_always_keeps_the_top_token():
    logits = probs_logits([0.2, 0.7, 0.1])
    assert set(seeded_counts(logits, 300, top_p=1e-6)) == {1}


def test_top_p_is_a_share_of_what_top_k_kept():
    # Within the top 3, token 1 brings the kept share to 0.7 / 0.9 >= 0.75.
    logits = probs_logits([0.4, 0.3, 0.2, 0.1])
    assert set(seeded_counts(logits, 2000, top_k=3, top_p=0.75)) == {0, 1}


def test_min_p_excludes_low_tokens():
    logits = probs_logits([0.5, 0.3, 0.15, 0.05])
    n = 3000
    assert set(seeded_counts(logits, n, min_p=0.2)) == {0, 1, 2}
    counts = seeded_counts(logits, n, min_p=0.5)
    assert set(counts) == {0, 1}
    assert_matches(counts, [0.5 / 0.8, 0.3 / 0.8, 0, 0], n, tol=0.04)


def test_wide_nucleus_matches_a_sorted_reference():
    vocab, top_p = 6000, 0.5
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 0.3
    sorted_probs, order = torch.softmax(logits, -1).sort(descending=True)
    size = int((sorted_probs.cumsum(0) < top_p).sum()) + 1
    assert size > 1000  # far wider than a short candidate list
    rank = {t: r for r, t in enumerate(order.tolist())}
    counts = seeded_counts(logits, 2000, top_p=top_p)
    ranks = [rank[t] for t in counts.elements()]
    assert max(ranks) < size
    assert sum(r >= 0.8 * size for r in ranks) > 200  # the nucleus' far end is reachable


def test_large_top_k_with_top_p_matches_a_sorted_reference():
    vocab, top_k, top_p = 2000, 300, 0.5
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(4)) * 0.3
    sorted_probs, order = torch.softmax(logits, -1).sort(descending=True)
    kept = sorted_probs[:top_k] / sorted_probs[:top_k].sum()
    size = int((kept.cumsum(0) < top_p).sum()) + 1
    counts = seeded_counts(logits, 4000, top_k=top_k, top_p=top_p)
    assert set(counts) == set(order[:size].tolist())
    assert set(seeded_counts(logits, 500, top_k=top_k)) <= set(order[:top_k].tolist())


def test_tiny_temperature_is_near_greedy():
    logits = torch.tensor([0.0, 1.0, 0.999, -5.0])
    assert set(seeded_counts(logits, 200, temperature=1e-30)) == {1}


def test_never_draws_a_zero_probability_token(monkeypatch):
    # exp(-200) underflows to zero in float32; -inf is masked outright.
    logits = torch.tensor([-float("inf"), -200.0, 0.0, 1.0, -200.0, -float("inf")])
    for u in (0.0, 1 - 2**-24):
        monkeypatch.setattr(RequestSampler, "uniform", lambda self, u=u: u)
        for params in ({}, {"top_k": 4}, {"top_p": 0.999999}, {"min_p": 1e-30}):
            token = draw(logits, make(6, **params))
            assert token == (2 if u == 0.0 else 3), (u, params)


def test_masked_row_raises():
    mask = torch.zeros(1, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="rows \\[0\\]"):
        sample(torch.zeros(1, 5), [make(5)], vocab_mask=mask)


# ---------------------------------------------------------------- logit adjustments


def adjusted_logprobs(logits: torch.Tensor, req: RequestSampler, **kw) -> torch.Tensor:
    """Log-probabilities the sampler reports for every token, via top_logprobs."""
    vocab = logits.shape[0]
    top = sample(logits[None], [req], top_logprobs_nums=[vocab], **kw).top_logprobs[0]
    out = torch.empty(vocab)
    for token, lp in top:
        out[token] = lp
    return out


def test_frequency_penalty_pushes_repeated_token_below_alternative():
    logits = torch.tensor([1.0, 0.8, 0.0])
    req = make(3, temperature=0.0, frequency_penalty=0.5)
    assert draw(logits, req) == 0
    req.record(0)
    assert draw(logits, req) == 1


def test_frequency_and_presence_penalties_follow_openai():
    logits = torch.tensor([1.0, 0.8, 0.0, 0.3])
    req = make(4, prompt=[3], frequency_penalty=0.5, presence_penalty=0.3)
    for t in (0, 0, 1):
        req.record(t)
    # Counts 2, 1, 0; the prompt token 3 is not penalised.
    expected = torch.tensor([1.0 - 2 * 0.5 - 0.3, 0.8 - 0.5 - 0.3, 0.0, 0.3])
    got = adjusted_logprobs(logits, req)
    torch.testing.assert_close(got, torch.log_softmax(expected, -1))


def test_negative_frequency_penalty_encourages_repeats():
    logits = torch.tensor([0.0, 0.5])
    req = make(2, temperature=0.0, frequency_penalty=-1.0)
    req.record(0)
    assert draw(logits, req) == 0


def test_repetition_penalty_covers_prompt_and_output():
    logits = torch.tensor([2.0, 1.5, -1.0, -0.5])
    req = make(4, prompt=[0, 2], temperature=0.0, repetition_penalty=2.0)
    expected = torch.tensor([1.0, 1.5, -2.0, -0.5])
    torch.testing.assert_close(adjusted_logprobs(logits, req), torch.log_softmax(expected, -1))
    assert draw(logits, req) == 1
    req.record(1)
    assert draw(logits, req) == 0  # 1.5 / 2 now trails 2.0 / 2


def test_min_new_tokens_blocks_eos_and_stop_ids():
    logits = torch.tensor([0.0, 1.0, 3.0, 4.0])
    req = make(4, eos=[3], temperature=0.0, min_new_tokens=2, stop_token_ids=[2])
    sampled = make(4, seed=1, eos=[3], min_new_tokens=2, stop_token_ids=[2])
    for _ in range(2):
        assert draw(logits, req) == 1
        assert all(draw(logits, sampled) in (0, 1) for _ in range(20))
        req.record(1)
        sampled.record(1)
    assert draw(logits, req) == 3


def test_vocab_mask_respected_even_when_greedy():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    mask = torch.tensor([[True, False, True, True]])
    out = sample(logits, [make(4, temperature=0.0)], vocab_mask=mask)
    assert out.token_ids == [3]
    allowed = torch.tensor([0.0, -float("inf"), 1.0, 2.0])
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(allowed, -1)[3].item())
    for s in range(50):
        assert sample(logits, [make(4, seed=s)], vocab_mask=mask).token_ids[0] != 1


def test_input_logits_are_not_modified():
    logits = torch.randn(2, 10)
    before = logits.clone()
    reqs = [
        make(10, prompt=[1, 2], repetition_penalty=1.5, frequency_penalty=1.0),
        make(10, eos=[0], min_new_tokens=3),
    ]
    reqs[0].record(4)
    sample(logits, reqs, vocab_mask=torch.rand(2, 10) > 0.3)
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_log_softmax_before_temperature():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 50, generator=gen) * 2
    reqs = [
        make(50, temperature=0.0),
        make(50, seed=1, temperature=0.5),
        make(50, seed=2, top_k=5),
        make(50, seed=3, temperature=1.5, top_p=0.8),
    ]
    out = sample(logits, reqs, top_logprobs_nums=[0, 3, 5, 1])
    ref = torch.log_softmax(logits, -1)
    for i, token in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(ref[i, token].item(), abs=1e-5)
    assert out.top_logprobs[0] == []
    for i, n in ((1, 3), (2, 5), (3, 1)):
        top = out.top_logprobs[i]
        values, ids = ref[i].topk(n)
        assert [t for t, _ in top] == ids.tolist()
        assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=1e-5)
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:], strict=False))


def test_no_top_logprobs_by_default():
    out = sample(torch.randn(2, 8), [make(8), make(8, seed=1)])
    assert out.top_logprobs == [[], []]
    assert all(math.isfinite(lp) and lp <= 0 for lp in out.logprobs)


# ---------------------------------------------------------------- mixed batches


def test_mixed_batch_matches_each_row_alone():
    vocab = 300
    params = [
        {"temperature": 0.0},
        {"temperature": 0.9},
        {"top_k": 1},
        {"top_k": 10, "temperature": 1.3},
        {"top_p": 0.8},
        {"min_p": 0.2},
        {"temperature": 0.0, "frequency_penalty": 1.0},
        {"repetition_penalty": 1.3, "presence_penalty": 0.5, "top_p": 0.95},
        {"min_new_tokens": 4, "temperature": 0.0},
    ]
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(len(params), vocab, generator=gen) * 2
    logits[:, 0] += 6  # make eos attractive so min_new_tokens matters

    def build() -> list[RequestSampler]:
        reqs = [make(vocab, seed=20 + i, prompt=[5, 6], eos=[0], **p) for i, p in enumerate(params)]
        for r in reqs:
            for t in (5, 7, 7):
                r.record(t)
        return reqs

    batch = sample(logits, build(), top_logprobs_nums=[2] * len(params))
    for i, req in enumerate(build()):
        alone = sample(logits[i : i + 1], [req], top_logprobs_nums=[2])
        assert batch.token_ids[i] == alone.token_ids[0], params[i]
        assert batch.logprobs[i] == pytest.approx(alone.logprobs[0], abs=1e-6)
        assert [t for t, _ in batch.top_logprobs[i]] == [t for t, _ in alone.top_logprobs[0]]
    assert batch.token_ids[-1] != 0


def test_without_logprobs_picks_the_same_tokens():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    greedy = [make(40, seed=i, temperature=0.0) for i in range(6)]
    mixed = [make(40, seed=i, temperature=0.0 if i % 2 else 0.7) for i in range(6)]
    for reqs in (greedy, mixed):
        full = sample(logits, reqs)
        fast = sample(logits, reqs, with_logprobs=False)
        assert fast.token_ids == full.token_ids
    assert sample(logits, greedy, with_logprobs=False).logprobs == []


# ---------------------------------------------------------------- logit_bias


def test_logit_bias_reads_json_keys_and_checks_bounds():
    p = SamplingParams.from_dict({"logit_bias": {"7": -100, 3: 2.5}})
    assert p.logit_bias == {7: -100.0, 3: 2.5}
    assert SamplingParams.from_dict({"logit_bias": None}).logit_bias == {}
    p.validate(vocab_size=8)
    with pytest.raises(ValueError, match="logit_bias keys.*< vocab size 7, got 7"):
        p.validate(vocab_size=7)
    for bad, message in [
        ({"1": 100.5}, r"logit_bias values must be in \[-100, 100\], got 100.5"),
        ({"1": -101}, r"logit_bias values must be in \[-100, 100\]"),
        ({"-1": 1}, "logit_bias keys must be token ids >= 0, got -1"),
        ({"abc": 1}, "logit_bias keys must be token ids, got 'abc'"),
        ({"1": "high"}, "logit_bias must map token ids to numbers"),
        ({"1": float("nan")}, "logit_bias must map token ids to numbers"),
        ({"1": True}, "logit_bias must map token ids to numbers"),
        ([1, 2], "logit_bias must map token ids to numbers"),
    ]:
        with pytest.raises(ValueError, match=message):
            SamplingParams.from_dict({"logit_bias": bad})


def test_logit_bias_plus_100_forces_the_token_at_temperature_1():
    logits = torch.tensor([6.0, 5.0, 4.0, -3.0])
    for seed in range(20):
        req = make(4, seed=seed, logit_bias={3: 100.0})
        for _ in range(5):
            token = draw(logits, req)
            assert token == 3
            req.record(token)


def test_logit_bias_minus_100_bans_the_greedy_token():
    logits = torch.tensor([1.0, 4.0, 3.9, 0.0])
    greedy = make(4, temperature=0.0, logit_bias={1: -100.0})
    assert draw(logits, greedy) == 2
    assert sample(logits[None], [greedy], with_logprobs=False).token_ids == [2]
    counts = seeded_counts(logits, 200, logit_bias={1: -100})
    assert counts[1] == 0 and counts[2] > 0


def test_logit_bias_shifts_the_distribution_and_logprobs():
    logits = torch.tensor([1.0, 0.0, 0.5])
    req = make(3, logit_bias={1: 2.0, 2: -0.5})
    expected = torch.log_softmax(torch.tensor([1.0, 2.0, 0.0]), -1)
    torch.testing.assert_close(adjusted_logprobs(logits, req), expected)


def test_logit_bias_comes_before_penalties_and_masks():
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.5]])
    # Biased to 3.0 first, then the repetition penalty halves it: 1.5 trails token 0's 2.0.
    req = make(4, prompt=[1], temperature=0.0, repetition_penalty=2.0, logit_bias={1: 2.0})
    expected = torch.log_softmax(torch.tensor([2.0, 1.5, 0.0, 0.5]), -1)
    torch.testing.assert_close(adjusted_logprobs(logits[0], req), expected)
    assert draw(logits[0], req) == 0
    # A masked token stays out whatever its bias; so does an end token before min_new_tokens.
    mask = torch.tensor([[True, False, True, True]])
    for seed in range(20):
        forced = make(4, seed=seed, logit_bias={1: 100.0, 2: 100.0}, eos=[2], min_new_tokens=1)
        assert sample(logits, [forced], vocab_mask=mask).token_ids[0] in (0, 3)


def test_logit_bias_rows_stay_apart_in_a_batch():
    logits = torch.zeros(3, 5)
    reqs = [make(5, temperature=0.0, logit_bias={4: 1.0}), make(5, temperature=0.0),
            make(5, temperature=0.0, logit_bias={2: 3.0, 4: -1.0})]
    before = logits.clone()
    assert sample(logits, reqs).token_ids == [4, 0, 2]
    assert torch.equal(logits, before)
