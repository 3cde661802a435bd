"""Speculative decoding's drafting (the n-gram store, draft trees, adaptive draft sizes) and
the scheduler verifying drafts against a model-free worker: the same output as without
drafts, every KV slot accounted for after every step."""

from __future__ import annotations

import random

import pytest
from engine_helpers import assert_nothing_held
from fake_worker import FakeWorker, reference_output
from test_scheduler import make_req, run
from tiny_model import draft_script, emitted, forward_script, save_tiny_model, tokens

from radixmesh.core.settings import SpeculativeSettings
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler import Scheduler
from radixmesh.engine.scheduler_config import SchedulerConfig
from radixmesh.engine.speculation import NgramSpeculation, NgramStore, grow_tree

NGRAM = SpeculativeSettings(speculative_algorithm="NGRAM")


def written(store: NgramStore, tokens: list[int]) -> NgramStore:
    cursor: list = []
    for token in tokens:
        cursor = store.extend(cursor, token)
    return store


def node(store: NgramStore, path: list[int]):
    at = store.root
    for token in path:
        at = at.children[token]
    return at


def test_the_store_counts_every_suffix_up_to_its_depth() -> None:
    store = written(NgramStore(max_depth=3, capacity=1000), [1, 2, 3, 1, 2, 4])
    assert node(store, [1, 2]).count == 2
    assert sorted(node(store, [1, 2]).children) == [3, 4]
    assert node(store, [2, 3, 1]).count == 1
    assert 2 not in node(store, [3, 1, 2]).children  # depth 3: no fourth token
    # 1 2 3 4 as unigrams, 12 23 31 24 as bigrams, 123 231 312 124 as trigrams
    assert store.size == 4 + 4 + 4


def test_a_full_store_drops_its_oldest_half() -> None:
    store = NgramStore(max_depth=2, capacity=1000)
    rng = random.Random(0)
    written(store, [rng.randrange(10_000) for _ in range(2000)])
    assert store.generation >= 1
    assert store.size <= 1000
    recent = [7, 8, 9]
    written(store, recent)
    assert node(store, [7, 8]).count >= 1  # what was written last survives


def test_bfs_tree_takes_recent_continuations_level_by_level() -> None:
    store = written(NgramStore(max_depth=6, capacity=1000), [5, 1, 2, 3, 9, 5, 1, 2, 4, 8, 5, 1])
    # After "5 1": "2" twice; below "5 1 2": "3" (older) and "4" (newer).
    tree = grow_tree(node(store, [5, 1]), budget=4, root_breadth=2, breadth=2,
                     branch_length=4, by_count=False)
    assert tree.tokens == [2, 4, 3, 8]
    assert tree.parents == [-1, 0, 0, 1]
    narrow = grow_tree(node(store, [5, 1]), budget=8, root_breadth=1, breadth=1,
                       branch_length=2, by_count=False)
    assert narrow.tokens == [2, 4] and narrow.parents == [-1, 0]


def test_prob_tree_takes_the_most_frequent_paths_first() -> None:
    store = written(NgramStore(max_depth=4, capacity=1000),
                    [7, 1, 0, 7, 1, 0, 7, 1, 0, 7, 2, 0, 7])
    tree = grow_tree(node(store, [7]), budget=3, root_breadth=1, breadth=1,
                     branch_length=3, by_count=True)
    # 1 (3/4), then 1 0 (3/4), then 1 0 7 (3/4 * 1 * 3/3) before 2 (1/4)
    assert tree.tokens == [1, 0, 7] and tree.parents == [-1, 0, 1]


def test_a_request_drafts_what_it_said_before() -> None:
    spec = NgramSpeculation(NGRAM)
    req = make_req("r", [10, 11, 12, 13, 14, 10, 11], max_new=20)
    draft = spec.draft(req, limit=3)
    assert draft is not None
    assert draft.tokens == [12, 13, 14] and draft.parents == [-1, 0, 1]
    assert spec.draft(req, limit=0) is None


def timed(spec: NgramSpeculation, one_row_ms: float, per_row_ms: float) -> None:
    """Steps of 1 and 9 rows timed as a + b * rows."""
    for _ in range(40):
        spec.cost.add(1, one_row_ms)
        spec.cost.add(9, one_row_ms + 8 * per_row_ms)


def test_a_draft_is_as_long_as_its_tokens_are_worth_their_rows() -> None:
    copying = make_req("r", [1, 2, 3] * 10, max_new=1000)
    cheap = NgramSpeculation(NGRAM)
    timed(cheap, 5.0, 0.05)  # a row costs 1% of a step: a GPU
    assert cheap.cost.row_share(1) == pytest.approx(0.05 / 5.05, rel=0.15)  # the prior fading
    # p = 1/2 before any verify: 0.5**6 > 0.01; a 12-token match leaves 6 levels of an
    # 18-deep trie below it
    assert len(cheap.draft(copying, limit=100).tokens) == 6
    dear = NgramSpeculation(NGRAM)
    timed(dear, 4.0, 1.0)  # a row costs a fifth of a one-row step: this CPU
    assert len(dear.draft(copying, limit=100).tokens) == 2  # 0.5, 0.25 > 0.2 > 0.125
    for _ in range(6):
        dear.verified(copying, 4, 4, 4)  # every draft taken: p near 0.96
    assert len(dear.draft(copying, limit=100).tokens) == 6
    assert dear.draft(copying, limit=3).tokens == [1, 2, 3]
    # In a batch of 32 a row costs 32 / (4 + 32) of the step: only a sure token pays.
    assert len(dear.draft(copying, limit=100, batch=32).tokens) <= 1


def test_failing_drafts_pause_then_try_again() -> None:
    spec = NgramSpeculation(NGRAM)
    timed(spec, 4.0, 1.0)
    req = make_req("r", [1, 2, 3] * 10, max_new=1000)
    sizes = []
    for _ in range(40):
        draft = spec.draft(req, limit=100) if spec.drafts(req) else None
        sizes.append(0 if draft is None else len(draft.tokens))
        if draft is not None:
            spec.verified(req, len(draft.tokens), len(draft.tokens), 0)
    assert sizes[:2] == [2, 1]
    assert 0 in sizes[2:12]  # paused after a few failures at one token
    assert sizes.count(0) > 30  # mostly paused, the pauses growing
    tries = [i for i, n in enumerate(sizes) if n]
    assert tries[-1] > 12  # it still tries now and then
    assert spec.stats.verify_steps == len(tries) and spec.stats.accepted_tokens == 0


def test_where_rows_are_dear_a_failed_first_draft_is_tried_again() -> None:
    """A row costing over a third of a step (a slow CPU's attention): after one rejected
    token p = 1/3 is below the row's cost, yet the request probes one token after each pause,
    and once a probe is accepted it drafts on its own again."""
    spec = NgramSpeculation(NGRAM)
    timed(spec, 16.0, 6.0)  # a row: 6 / 16 of a one-row step
    req = make_req("r", [1, 2, 3] * 10, max_new=1000)
    first = spec.draft(req, limit=100)
    assert first is not None and len(first.tokens) == 1  # p = 1/2 > 0.375
    spec.verified(req, 1, 1, 0)
    sizes = []
    for _ in range(12):
        draft = spec.draft(req, limit=100) if spec.drafts(req) else None
        sizes.append(0 if draft is None else len(draft.tokens))
    assert sizes == [0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0]  # paused 4 steps, one probe
    spec.verified(req, 1, 1, 1)  # the probe is accepted: p = 2/4 beats 0.375 again
    draft = spec.draft(req, limit=100)
    assert draft is not None and len(draft.tokens) == 1


def period(n: int):
    """A model that repeats the token n back: its output copies its context."""
    return lambda tokens: tokens[-n] if len(tokens) >= n else 0


def mostly(n: int, every: int):
    """Copies the token n back, but at every `every`-th position says something new: drafts
    are taken up to there and rejected from there on."""
    return lambda tokens: (tokens[-1] + 1) % 50 if len(tokens) % every == 0 else tokens[-n]


def spec_scheduler(num_slots: int, page_size: int = 1, chunk: int = 1024,
                   **kw: object) -> Scheduler:
    cfg = SchedulerConfig(num_slots=num_slots, page_size=page_size, chunked_prefill_size=chunk,
                          speculative=NGRAM, **kw)  # type: ignore[arg-type]
    return Scheduler(cfg)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("chunk", [7, 1024])
def test_drafted_output_matches_running_alone(overlap: bool, page_size: int, chunk: int) -> None:
    model = mostly(5, 11)
    sched = spec_scheduler(4096, page_size, chunk)
    worker = FakeWorker(4096, model=model)
    rng = random.Random(3)
    prompts = [[rng.randrange(50) for _ in range(rng.randint(5, 30))] for _ in range(8)]
    reqs = [make_req(f"r{i}", p, max_new=10 + 7 * i) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    run(sched, worker, overlap)
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_ids == reference_output(p, r.params.max_new_tokens, model=model)
    stats = sched.speculation.stats
    assert worker.accepted == stats.accepted_tokens == sum(r.spec_accepted_tokens for r in reqs)
    # A period-5 copy is drafted right after its first period: most tokens come from drafts,
    # and some drafts are cut short.
    assert stats.accepted_tokens > sum(len(r.output_ids) for r in reqs) // 3
    assert stats.accepted_tokens < stats.drafted_tokens
    assert sched.held_slots() == 0
    assert sched.allocator.available() + sched.cache.total_size() == 4096


def test_nothing_to_copy_drafts_little() -> None:
    sched = spec_scheduler(4096)
    worker = FakeWorker(4096)  # next_token: no repeats to copy
    reqs = [make_req(f"r{i}", [i, i + 1, i + 2] * 4, max_new=200) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    steps = run(sched, worker, overlap=True)
    for r in reqs:
        assert r.output_ids == reference_output(r.input_ids, 200)
    assert sum(r.spec_verify_ct for r in reqs) < 60  # paused most of the way
    assert steps < 260


@pytest.mark.parametrize("overlap", [False, True])
def test_drafts_under_memory_pressure_and_aborts_leak_nothing(overlap: bool) -> None:
    model = period(3)
    sched = spec_scheduler(192, page_size=4, chunk=16, decode_reserve_ratio=0.0)
    worker = FakeWorker(192, model=model)
    rng = random.Random(7)
    reqs: list[Req] = []
    for i in range(24):
        r = make_req(f"r{i}", [rng.randrange(50) for _ in range(rng.randint(3, 40))],
                     max_new=rng.randint(5, 60))
        reqs.append(r)
        sched.add_request(r)

    def abort_some(step: int) -> None:
        if step % 5 == 0:
            victim = rng.choice(reqs)
            sched.abort(victim.rid)

    run(sched, worker, overlap, on_step=abort_some)
    assert sched.num_retractions > 0
    assert all(r.finish is not None for r in reqs)
    for r in reqs:
        if r.finish is not None and r.finish.kind.value != "abort":
            assert r.output_ids == reference_output(r.input_ids, r.params.max_new_tokens,
                                                    model=model)
    assert sched.held_slots() == 0
    assert sched.allocator.available() + sched.cache.total_size() == 192
    assert sched.speculation.stats.accepted_tokens > 0


# ---- the bundled model --------------------------------------------------------------------

COPY = ("Copy this list: apple, banana, cherry, plum, apple, banana, cherry, plum, apple, "
        "banana, cherry, plum, apple,")


@pytest.fixture(scope="module")
def ngram_engine():
    """The bundled model in float32 (as conftest's `engine`), drafting n-grams."""
    from radixmesh.api import Engine

    eng = Engine(dtype="float32", max_total_tokens=8192, show_progress=False, random_seed=0,
                 speculative_algorithm="NGRAM")
    yield eng
    eng.shutdown()


def test_sampling_with_drafts_keeps_the_distribution(engine, ngram_engine) -> None:
    """A verify step samples each token with the sampler state and the (seed, position) draw
    a plain decode step would use, so the same seed gives the same text unless float
    rounding flips a near tie: over 48 seeds at temperature 0.8, at least 44 agree token for
    token, and the pooled token frequencies differ by a total variation of at most 0.1."""
    n, group = 48, 4  # in small batches, where drafts are worth their rows
    params = [{"temperature": 0.8, "max_new_tokens": 16, "seed": s} for s in range(n)]
    off = engine.generate([COPY] * n, params)
    before = ngram_engine.server_info()
    on = [out for i in range(0, n, group)
          for out in ngram_engine.generate([COPY] * group, params[i : i + group])]
    after = ngram_engine.server_info()
    assert after["spec_accepted_tokens"] - before["spec_accepted_tokens"] > n
    same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(off, on, strict=True))
    assert same >= n - 4
    counts: dict[int, list[int]] = {}
    for side, outs in enumerate((off, on)):
        for out in outs:
            for token in out["output_ids"]:
                counts.setdefault(token, [0, 0])[side] += 1
    totals = [sum(c[side] for c in counts.values()) for side in (0, 1)]
    tv = sum(abs(a / totals[0] - b / totals[1]) for a, b in counts.values()) / 2
    assert tv <= 0.1, tv
    for out in on:
        meta = out["meta_info"]
        if "spec_verify_ct" in meta:
            assert meta["spec_accept_length"] == pytest.approx(
                (meta["spec_accepted_tokens"] + meta["spec_verify_ct"]) / meta["spec_verify_ct"],
                abs=1e-4)
    assert_nothing_held(ngram_engine)


# ---- the model runner verifying trees (a tiny random model) -------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_the_runner_accepts_exactly_the_model_s_own_tokens(tmp_path, kind) -> None:
    """A tree with a wrong sibling and a wrong leaf: the runner takes the right path, its
    K/V moved to where the next plain step reads it; the tokens are those of plain decoding
    (the seeded request's too: each draw is the one a plain step would make)."""
    runner = tiny_runner(tmp_path, kind)
    ref = tokens([runner.forward(b) for b in forward_script()])
    steps, expected = draft_script(ref)
    runner = tiny_runner(tmp_path, kind)
    assert emitted([runner.forward(b) for b in steps]) == expected


def tiny_runner(tmp_path, kind: str):
    import torch

    from radixmesh.engine.model.model_source import load_model
    from radixmesh.engine.model.runner import ModelRunner

    loaded = load_model(str(save_tiny_model(tmp_path / kind, kind)), progress=False)
    return ModelRunner(loaded.config, loaded.weights, torch.float32, 256)


def test_drafts_under_memory_pressure_with_the_host_tier(engine) -> None:
    """A pool too small for the batch: requests are retracted and readmitted, their prefixes
    go to the host tier and come back, drafts are verified throughout, and every answer is
    the one without drafts in a pool that holds them all."""
    words = ["red green blue", "one two three", "north south east west", "spring summer fall",
             "apple pear plum", "left right up down"]
    prompts = [f"Write '{w}' again and again: {w}, {w}, {w}," for w in words]
    params = {"temperature": 0, "max_new_tokens": 160, "ignore_eos": True}
    expected = [o["output_ids"] for o in engine.generate(prompts, params)]
    from radixmesh.api import Engine

    with Engine(dtype="float32", max_total_tokens=640, enable_hierarchical_cache=True,
                hicache_ratio=4, speculative_algorithm="NGRAM", show_progress=False) as small:
        got = [o["output_ids"] for o in small.generate(prompts, params)]
        info = assert_nothing_held(small)
    assert got == expected
    assert info["num_retractions"] > 0 and info["spec_accepted_tokens"] > 0
    assert info["host_cached_tokens"] > 0


def test_logit_bias_holds_when_drafts_are_verified(ngram_engine) -> None:
    """Verify steps sample through the same biased logits as plain decode steps."""
    tok = ngram_engine.tokenizer
    params = {"temperature": 0, "max_new_tokens": 24}
    plain = ngram_engine.generate(COPY, params)["output_ids"]
    apple = tok.encode(" apple")[0]
    assert apple in plain
    banned = ngram_engine.generate(COPY, {**params, "logit_bias": {apple: -100}})["output_ids"]
    assert apple not in banned and banned != plain
    before = ngram_engine.server_info()["spec_accepted_tokens"]
    forced = ngram_engine.generate(COPY, {**params, "seed": 7, "temperature": 1.0,
                                          "logit_bias": {apple: 100}})["output_ids"]
    assert forced == [apple] * 24
    assert ngram_engine.server_info()["spec_accepted_tokens"] > before
