"""The scheduler against a model-free worker: batching, chunking, caching, retraction, aborts."""

from __future__ import annotations

import random

import pytest
from fake_worker import JUMPING, FakeWorker, reference_output

from radixmesh.core.finish import FinishKind
from radixmesh.core.sampling_params import SamplingParams
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler import Scheduler
from radixmesh.engine.scheduler_config import SchedulerConfig


def make_req(rid: str, prompt: list[int], max_new: int = 8, constrained: bool = False,
             **kw: object) -> Req:
    """A greedy request; `constrained`: under JUMPING, so the fake worker may jump forward."""
    params = SamplingParams(max_new_tokens=max_new, regex=JUMPING[1] if constrained else None)
    return Req(rid=rid, input_ids=prompt, params=params, seed=0, **kw)


def run(
    sched: Scheduler,
    worker: FakeWorker,
    overlap: bool,
    max_steps: int = 10_000,
    on_step: object = None,
) -> int:
    """Drive the scheduler like the engine does; check invariants after every step."""
    in_flight = None
    steps = 0
    while sched.has_work() or in_flight is not None:
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
        batch = sched.schedule()
        if overlap:
            done = (batch, worker.forward(batch.batch)) if batch else None
            if in_flight is not None:
                sched.process_result(*in_flight)
            in_flight = done
        elif batch is not None:
            sched.process_result(batch, worker.forward(batch.batch))
        sched.check_invariants()
        if on_step is not None:
            on_step(steps)  # type: ignore[operator]
    return steps


def prompts(n: int, seed: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(50) for _ in range(shared)]
    return [base + [rng.randrange(50) for _ in range(rng.randint(1, 40))] for _ in range(n)]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("chunk", [7, 1024])
def test_outputs_match_running_alone(overlap: bool, page_size: int, chunk: int) -> None:
    cfg = SchedulerConfig(num_slots=4096, page_size=page_size, chunked_prefill_size=chunk)
    sched, worker = Scheduler(cfg), FakeWorker(4096)
    ps = prompts(16, seed=1, shared=20)
    reqs = [make_req(f"r{i}", p, max_new=5 + i) for i, p in enumerate(ps)]
    for r in reqs:
        sched.add_request(r)
    run(sched, worker, overlap)
    for r, p in zip(reqs, ps, strict=True):
        assert r.output_ids == reference_output(p, r.params.max_new_tokens)
        assert r.finish is not None and r.finish.kind is FinishKind.LENGTH
    assert sched.held_slots() == 0
    assert sched.allocator.available() + sched.cache.total_size() == cfg.num_slots


def test_second_request_hits_the_first_ones_prefix() -> None:
    sched, worker = Scheduler(SchedulerConfig(num_slots=1024)), FakeWorker(1024)
    first = make_req("a", list(range(30)), max_new=4)
    sched.add_request(first)
    run(sched, worker, overlap=False)
    second = make_req("b", list(range(30)) + [7, 7], max_new=4)
    sched.add_request(second)
    run(sched, worker, overlap=False)
    # All of "a"'s prompt and the three output tokens that were fed back are cached.
    assert second.cached_tokens == 30
    turn2 = make_req("c", first.tokens + [1, 2, 3], max_new=2)
    sched.add_request(turn2)
    run(sched, worker, overlap=False)
    assert turn2.cached_tokens == 30 + 3  # the last output token was never fed


def test_same_prefix_in_one_batch_is_computed_once() -> None:
    sched, worker = Scheduler(SchedulerConfig(num_slots=2048)), FakeWorker(2048)
    shared = list(range(40))
    reqs = [make_req(f"r{i}", shared + [i, i], max_new=2) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    batch = sched.schedule()
    assert batch is not None
    fed = [len(e.input_ids) for e in batch.batch.entries]
    assert fed == [42, 2, 2, 2]
    sched.process_result(batch, worker.forward(batch.batch))
    run(sched, worker, overlap=False)
    assert [r.output_ids for r in reqs] == [reference_output(shared + [i, i], 2) for i in range(4)]


def test_namespaces_do_not_share() -> None:
    sched, worker = Scheduler(SchedulerConfig(num_slots=1024)), FakeWorker(1024)
    a = make_req("a", list(range(30)), namespace="tenant-a")
    sched.add_request(a)
    run(sched, worker, overlap=False)
    b = make_req("b", list(range(30)), namespace="tenant-b")
    c = make_req("c", list(range(30)), namespace="tenant-a")
    sched.add_request(b)
    sched.add_request(c)
    run(sched, worker, overlap=False)
    assert b.cached_tokens == 0
    assert c.cached_tokens == 29


def test_chunked_prefill_respects_the_budget() -> None:
    sched, worker = (
        Scheduler(SchedulerConfig(num_slots=1024, chunked_prefill_size=16)),
        FakeWorker(1024),
    )
    sched.add_request(make_req("long", list(range(50)) * 2, max_new=3))
    sched.add_request(make_req("short", [1, 2, 3], max_new=20))
    sizes = []
    while sched.has_work():
        batch = sched.schedule()
        assert batch is not None
        sizes.append(sum(len(e.input_ids) for e in batch.batch.entries))
        sched.process_result(batch, worker.forward(batch.batch))
    assert max(sizes) <= 16
    assert sizes[:7] == [16] * 6 + [4 + 3]


def test_memory_pressure_retracts_and_finishes_everything() -> None:
    cfg = SchedulerConfig(num_slots=160, chunked_prefill_size=64, decode_reserve_ratio=0.0)
    sched, worker = Scheduler(cfg), FakeWorker(160)
    ps = prompts(12, seed=3)
    reqs = [make_req(f"r{i}", p, max_new=30) for i, p in enumerate(ps)]
    for r in reqs:
        sched.add_request(r)
    run(sched, worker, overlap=True)
    assert sched.num_retractions > 0
    for r, p in zip(reqs, ps, strict=True):
        assert r.output_ids == reference_output(p, 30)
    assert sched.held_slots() == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_random_aborts_leak_nothing(overlap: bool) -> None:
    rng = random.Random(7)
    cfg = SchedulerConfig(num_slots=512, page_size=2, chunked_prefill_size=24)
    sched, worker = Scheduler(cfg), FakeWorker(512)
    reqs = [
        make_req(f"r{i}", p, max_new=rng.randint(1, 30)) for i, p in enumerate(prompts(40, 5, 10))
    ]
    for r in reqs[:20]:
        sched.add_request(r)
    later = reqs[20:]

    def chaos(step: int) -> None:
        if later and step % 3 == 0:
            sched.add_request(later.pop())
        if rng.random() < 0.3:
            sched.abort(rng.choice(reqs).rid)

    run(sched, worker, overlap, on_step=chaos)
    assert all(r.finish is not None for r in reqs)
    assert any(r.finish.kind is FinishKind.ABORT for r in reqs if r.finish)
    assert sched.held_slots() == 0
    assert sched.cache.protected_size() == 0
    assert sched.allocator.available() + sched.cache.total_size() == cfg.num_slots
    assert not worker.reqs, "the worker still holds released requests"


def test_stop_token_and_min_new_tokens() -> None:
    prompt = [3, 1, 4]
    ref = reference_output(prompt, 10)
    stop = ref[2]
    cfg = SchedulerConfig(num_slots=256, eos_token_ids=(stop,))
    sched, worker = Scheduler(cfg), FakeWorker(256)
    r = make_req("r", prompt, max_new=10)
    sched.add_request(r)
    run(sched, worker, overlap=False)
    assert r.output_ids == ref[: ref.index(stop) + 1]
    assert r.finish is not None and r.finish.kind is FinishKind.STOP and r.finish.matched == stop


@pytest.mark.parametrize("overlap", [False, True])
def test_each_way_a_decode_ends_in_one_batch(overlap: bool) -> None:
    """Plain decodes are folded a batch at a time: each request still ends by its own rule
    (the engine's stop id, its ignore_eos, its stop_token_ids, min_new_tokens, max_new_tokens
    or the context length), with exactly the tokens up to the one that ended it."""
    prompt = [3, 1, 4]
    ref = reference_output(prompt, 12)
    eos, own, late = ref[2], ref[4], ref[1]
    assert len({eos, own, late}) == 3 and ref.index(late) < ref.index(eos) < ref.index(own)
    cfg = SchedulerConfig(num_slots=512, eos_token_ids=(eos,), context_length=len(prompt) + 6)
    sched, worker = Scheduler(cfg), FakeWorker(512)
    cases = {
        "eos": (SamplingParams(max_new_tokens=10), ref[:3], FinishKind.STOP, eos),
        "ignore_eos": (SamplingParams(max_new_tokens=5, ignore_eos=True), ref[:5],
                       FinishKind.LENGTH, 5),
        "own": (SamplingParams(max_new_tokens=10, ignore_eos=True, stop_token_ids=[own]),
                ref[:5], FinishKind.STOP, own),
        "min_new": (SamplingParams(max_new_tokens=10, stop_token_ids=[late], min_new_tokens=2),
                    ref[:3], FinishKind.STOP, eos),
        "context": (SamplingParams(max_new_tokens=10, ignore_eos=True), ref[:6],
                    FinishKind.LENGTH, 6),
    }
    reqs = {rid: Req(rid=rid, input_ids=list(prompt), params=params, seed=0)
            for rid, (params, *_) in cases.items()}
    for req in reqs.values():
        sched.add_request(req)
    run(sched, worker, overlap=overlap)
    for rid, (_, output, kind, matched) in cases.items():
        req = reqs[rid]
        assert req.output_ids == output, rid
        assert req.finish is not None and (req.finish.kind, req.finish.matched) == (kind, matched)
    assert not sched.requests and sched.held_slots() == 0


def test_rejects_prompts_that_can_never_run() -> None:
    sched = Scheduler(SchedulerConfig(num_slots=64, context_length=32))
    with pytest.raises(ValueError, match="context length"):
        sched.add_request(make_req("a", list(range(40))))
    with pytest.raises(ValueError, match="input_ids"):
        sched.add_request(make_req("b", []))


def test_policies_admit_all() -> None:
    for policy in ("lpm", "dfs-weight", "fcfs"):
        cfg = SchedulerConfig(num_slots=2048, schedule_policy=policy, max_running_requests=4)
        sched, worker = Scheduler(cfg), FakeWorker(2048)
        ps = prompts(12, seed=9, shared=15)
        reqs = [make_req(f"r{i}", p, max_new=4) for i, p in enumerate(ps)]
        for r in reqs:
            sched.add_request(r)
        run(sched, worker, overlap=True)
        assert [r.output_ids for r in reqs] == [reference_output(p, 4) for p in ps]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_that_outgrows_the_pool_finishes_instead_of_spinning(overlap: bool) -> None:
    sched, worker = Scheduler(SchedulerConfig(num_slots=64)), FakeWorker(64)
    r = make_req("big", list(range(40)), max_new=100)
    sched.add_request(r)
    run(sched, worker, overlap, max_steps=200)
    assert r.finish is not None and r.finish.kind is FinishKind.LENGTH
    assert r.finish.message == "KV pool full"
    assert r.output_ids == reference_output(list(range(40)), len(r.output_ids))
    assert 20 <= len(r.output_ids) < 30
    assert sched.held_slots() == 0


def forced_after_multiples_of_seven(tokens: list[int]) -> list[int]:
    """A stand-in grammar: after a sampled token divisible by 7, three more are forced."""
    last = tokens[-1]
    return [(last + k) % 50 for k in (11, 12, 13)] if last % 7 == 0 else []


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_jump_forward_tokens_are_fed_once_in_order(overlap: bool, page_size: int) -> None:
    """Forced tokens join the output with their sampled token, the step run ahead for the
    request samples nothing, and the next decode feeds them all; the fake worker checks
    every slot holds the right token at the right position."""
    jump = forced_after_multiples_of_seven
    cfg = SchedulerConfig(num_slots=4096, page_size=page_size, chunked_prefill_size=16)
    sched, worker = Scheduler(cfg), FakeWorker(4096, jump=jump)
    ps = prompts(16, seed=11, shared=8)
    reqs = [make_req(f"r{i}", p, max_new=20 + i, constrained=True) for i, p in enumerate(ps)]
    for r in reqs:
        sched.add_request(r)
    steps = run(sched, worker, overlap)
    for r, p in zip(reqs, ps, strict=True):
        assert r.output_ids == reference_output(p, r.params.max_new_tokens, jump=jump)
        assert r.finish is not None and r.finish.kind is FinishKind.LENGTH
    assert sched.constraints.forced_tokens > 30
    assert sched.held_slots() == 0
    assert not worker.reqs and not worker.jumped
    # Fewer steps than without jumping: each forced run of three costs one step (two with
    # overlap, whose step run ahead feeds only the sampled token).
    plain = Scheduler(cfg)
    for i, p in enumerate(ps):
        plain.add_request(make_req(f"r{i}", p, max_new=20 + i, constrained=True))
    assert steps < run(plain, FakeWorker(4096), overlap)


@pytest.mark.parametrize("overlap", [False, True])
def test_jump_forward_under_memory_pressure_and_aborts(overlap: bool) -> None:
    jump = forced_after_multiples_of_seven
    rng = random.Random(3)
    cfg = SchedulerConfig(num_slots=192, page_size=2, chunked_prefill_size=32,
                          decode_reserve_ratio=0.0)
    sched, worker = Scheduler(cfg), FakeWorker(192, jump=jump)
    ps = prompts(14, seed=4)
    reqs = [make_req(f"r{i}", p, max_new=30, constrained=True) for i, p in enumerate(ps)]
    for r in reqs:
        sched.add_request(r)
    doomed = {r.rid for r in rng.sample(reqs, 3)}

    def abort_some(step: int) -> None:
        if step % 9 == 0 and doomed:
            sched.abort(doomed.pop())

    run(sched, worker, overlap, on_step=abort_some)
    assert sched.num_retractions > 0
    for r, p in zip(reqs, ps, strict=True):
        assert r.finish is not None
        if r.finish.kind is not FinishKind.ABORT:
            assert r.output_ids == reference_output(p, 30, jump=jump)
    assert sched.held_slots() == 0
    assert not worker.reqs


def test_forced_tokens_stop_at_max_new_tokens_and_stop_tokens() -> None:
    jump = forced_after_multiples_of_seven
    prompt = [3, 1, 4]
    ref = reference_output(prompt, 200, jump=jump)
    first_jump = next(i for i, t in enumerate(ref) if t % 7 == 0)
    # max_new_tokens ends inside the first forced run: the output is cut there.
    sched, worker = Scheduler(SchedulerConfig(num_slots=512)), FakeWorker(512, jump=jump)
    cut = make_req("cut", prompt, max_new=first_jump + 2, constrained=True)
    sched.add_request(cut)
    run(sched, worker, overlap=True)
    assert cut.output_ids == ref[: first_jump + 2]
    assert cut.finish is not None and cut.finish.kind is FinishKind.LENGTH
    # A forced token that is a stop token ends the request there.
    stop = ref[first_jump + 2]
    sched, worker = Scheduler(SchedulerConfig(num_slots=512)), FakeWorker(512, jump=jump)
    r = Req("stop", prompt, SamplingParams(max_new_tokens=200, stop_token_ids=[stop],
                                           regex=JUMPING[1]), seed=0)
    sched.add_request(r)
    run(sched, worker, overlap=True)
    assert r.output_ids == ref[: ref.index(stop) + 1]
    assert r.finish is not None and r.finish.kind is FinishKind.STOP
    assert sched.held_slots() == 0 and not worker.reqs


@pytest.mark.parametrize("overlap", [False, True])
def test_a_constrained_request_waits_for_its_compile_alone(overlap: bool) -> None:
    """A request is admitted once the worker reports its constraint compiled; free requests
    run meanwhile, one compile serves every request with the same constraint, and a failed
    compile ends its requests with the error."""
    slow, broken = ("regex", "[0-9]+"), ("ebnf", "root ::= broken")
    cfg = SchedulerConfig(num_slots=1024)
    sched = Scheduler(cfg)
    worker = FakeWorker(1024, compile_steps=6, broken=frozenset({broken}))
    free = make_req("free", [1, 2, 3], max_new=12)
    constrained = [
        Req(f"c{i}", [4, 5, i], SamplingParams(max_new_tokens=4, regex=slow[1]), seed=0)
        for i in range(2)
    ]
    bad = Req("bad", [6, 7], SamplingParams(max_new_tokens=4, ebnf=broken[1]), seed=0)
    for r in [free, *constrained, bad]:
        sched.add_request(r)
    admitted_at: dict[str, int] = {}

    def note(step: int) -> None:
        for rid, n in worker.sampled.items():
            if n:
                admitted_at.setdefault(rid, worker.steps)

    run(sched, worker, overlap, on_step=note)
    assert admitted_at["free"] == 1
    assert all(admitted_at[r.rid] > 6 for r in constrained)
    for r in constrained:
        assert r.output_ids == reference_output(r.input_ids, 4)
    assert bad.finish is not None and bad.finish.kind is FinishKind.ABORT
    assert bad.finish.message == "broken" and bad.finish.status == 400
    assert "bad" not in worker.sampled and not bad.output_ids
    assert free.output_ids == reference_output([1, 2, 3], 12)
    assert sched.held_slots() == 0 and not worker.reqs
    # Compiled once: a later request with the same constraint is admitted at once.
    again = Req("again", [8, 9], SamplingParams(max_new_tokens=2, regex=slow[1]), seed=0)
    sched.add_request(again)
    start = worker.steps
    run(sched, worker, overlap)
    assert worker.steps - start <= 3 and again.output_ids == reference_output([8, 9], 2)
