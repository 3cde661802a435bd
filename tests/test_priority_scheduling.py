"""Priority scheduling: the waiting queue by priority class (the schedule policy inside each
class), preemption of less important running requests for a seat or KV room, its metrics,
and the in-process engine admitting an important request first."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

import pytest
from fake_worker import FakeWorker, reference_output
from prometheus_client import REGISTRY
from test_schedule_policy import cache_with

from radixmesh.core.request import RequestError
from radixmesh.core.sampling_params import SamplingParams
from radixmesh.engine.priority import NoPriority, PriorityScheduling
from radixmesh.engine.radix_cache import RadixCache
from radixmesh.engine.request import Req
from radixmesh.engine.schedule_policy import SchedulePolicy
from radixmesh.engine.scheduler import ScheduledBatch, Scheduler
from radixmesh.engine.scheduler_config import SchedulerConfig
from radixmesh.services.scheduler.metrics import OTHER_PRIORITY, PriorityLabels, SchedulerMetrics

_ids = itertools.count(1)


def make_req(rid: str, priority: int = 0, length: int = 12, max_new: int = 8) -> Req:
    """A request whose prompt shares no first token with any other's, so no prefix match
    reorders the queue unless a test caches one on purpose."""
    base = next(_ids) * 1000
    prompt = [base + k for k in range(length)]
    return Req(rid, prompt, SamplingParams(max_new_tokens=max_new), seed=0, priority=priority)


def priority_config(**kw: object) -> SchedulerConfig:
    defaults: dict[str, object] = {
        "num_slots": 1024, "max_running_requests": 2, "enable_priority_scheduling": True,
    }
    return SchedulerConfig(**{**defaults, **kw})  # type: ignore[arg-type]


class Driver:
    """Steps the scheduler like the engine loop does, checking its invariants after every
    step and noting each (re)admission in order."""

    def __init__(self, sched: Scheduler, overlap: bool = False) -> None:
        self.sched = sched
        self.worker = FakeWorker(sched.config.num_slots)
        self.overlap = overlap
        self.admitted: list[str] = []
        self._in_flight: tuple[ScheduledBatch, object] | None = None

    def step(self) -> ScheduledBatch | None:
        batch = self.sched.schedule()
        if batch is not None:
            self.admitted += [n.rid for n in batch.batch.new_requests]
        done = (batch, self.worker.forward(batch.batch)) if batch else None
        if self.overlap:
            if self._in_flight is not None:
                self.sched.process_result(*self._in_flight)  # type: ignore[arg-type]
            self._in_flight = done
        elif done is not None:
            self.sched.process_result(*done)
        self.sched.check_invariants()
        return batch

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work() and self._in_flight is None:
                return
            self.step()
        raise AssertionError("the scheduler made no progress")

    def finish(self) -> None:
        self.run()
        assert self.sched.held_slots() == 0
        assert self.sched.cache.protected_size() == 0
        assert not self.worker.reqs, "the worker still holds released requests"


def assert_outputs_as_alone(*reqs: Req) -> None:
    for r in reqs:
        assert r.finish is not None
        assert r.output_ids == reference_output(r.input_ids, r.params.max_new_tokens), r.rid


# ---- the order of the waiting queue -------------------------------------------------------


def queue_in_classes() -> tuple[RadixCache, list[Req]]:
    """Two classes, each with a long and a short cached prefix and an uncached request,
    arriving mixed so that neither arrival nor prefix length alone gives the class order."""
    cache = cache_with(list(range(20)), [100, 101, 102])

    def r(rid: str, priority: int, prompt: list[int]) -> Req:
        return Req(rid, prompt, SamplingParams(), seed=0, priority=priority)

    return cache, [
        r("low-none", 0, [7, 7, 7]),
        r("high-short", 5, [100, 101, 102, 9]),
        r("low-long", 0, [*range(20), 9]),
        r("high-none", 5, [8, 8]),
        r("low-short", 0, [100, 101, 102, 8]),
        r("high-long", 5, [*range(20), 8]),
    ]


def test_priority_classes_come_first_and_lpm_orders_each_class() -> None:
    cache, queue = queue_in_classes()
    order = PriorityScheduling(False, 10).order(queue, SchedulePolicy("lpm", cache).order)
    assert [r.rid for r in order] == [
        "high-long", "high-short", "high-none", "low-long", "low-short", "low-none",
    ]


def test_low_values_first_puts_the_smallest_priority_first() -> None:
    cache, queue = queue_in_classes()
    order = PriorityScheduling(True, 10).order(queue, SchedulePolicy("lpm", cache).order)
    assert [r.rid for r in order] == [
        "low-long", "low-short", "low-none", "high-long", "high-short", "high-none",
    ]


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
def test_off_the_policy_alone_orders_the_queue(policy: str) -> None:
    cache, queue = queue_in_classes()
    ordered = SchedulePolicy(policy, cache).order
    assert NoPriority().order(queue, ordered) == ordered(queue)


# ---- preemption ---------------------------------------------------------------------------


def two_running(sched: Scheduler, driver: Driver, first: int = 0, second: int = 0
                ) -> tuple[Req, Req]:
    """Two requests running, `a` admitted first (whatever their priorities), the batch full."""
    a, b = make_req("a", first, max_new=20), make_req("b", second, max_new=20)
    sched.add_request(a)
    driver.step()
    sched.add_request(b)
    driver.step()
    assert sched.running == [a, b]
    return a, b


@pytest.mark.parametrize("overlap", [False, True])
def test_an_important_arrival_runs_before_the_queue_and_preempts_the_newest_low_one(
    overlap: bool,
) -> None:
    sched = Scheduler(priority_config())
    driver = Driver(sched, overlap)
    a, b = two_running(sched, driver)
    queued = [make_req("q1"), make_req("q2")]
    for r in queued:
        sched.add_request(r)
    driver.step()  # full: the queued low ones wait
    high = make_req("high", priority=20, max_new=5)
    sched.add_request(high)
    batch = driver.step()
    assert batch is not None
    assert [n.rid for n in batch.batch.new_requests] == ["high"]
    assert "b" not in [e.rid for e in batch.batch.entries]  # retracted before decodes
    assert sched.running == [a, high]
    assert b in sched.waiting and not b.slots
    assert sched.priority.preemptions == {0: 1}
    assert sched.stats()["num_preemptions"] == 1
    assert sched.num_retractions == 0  # memory pressure retracted nothing
    driver.finish()
    # b is readmitted once high is done (its cached progress puts it first in its class).
    assert driver.admitted == ["a", "b", "high", "b", "q1", "q2"]
    assert_outputs_as_alone(a, b, high, *queued)
    assert sched.priority.preemptions == {0: 1}


def test_the_least_important_running_request_is_preempted() -> None:
    sched = Scheduler(priority_config())
    driver = Driver(sched)
    a, b = two_running(sched, driver, first=0, second=3)  # b newer but more important
    high = make_req("high", priority=20)
    sched.add_request(high)
    driver.step()
    assert sched.running == [b, high] and a in sched.waiting
    assert sched.priority.preemptions == {0: 1}
    driver.finish()
    assert_outputs_as_alone(a, b, high)


def test_each_important_arrival_takes_one_seat_and_no_more() -> None:
    sched = Scheduler(priority_config())
    driver = Driver(sched)
    a, b = two_running(sched, driver)
    first, second = make_req("h1", priority=30), make_req("h2", priority=20)
    sched.add_request(first)
    driver.step()
    assert sched.running == [a, first] and sched.priority.preemptions == {0: 1}
    sched.add_request(second)
    driver.step()
    # h2 preempts a (the only low one left), never h1 (more important than it).
    assert sched.running == [first, second]
    assert sched.priority.preemptions == {0: 2}
    driver.finish()
    assert_outputs_as_alone(a, b, first, second)


@pytest.mark.parametrize(("priority", "preempts"), [(9, False), (10, True), (0, False)])
def test_the_threshold_is_the_least_difference_that_preempts(priority: int, preempts: bool
                                                              ) -> None:
    sched = Scheduler(priority_config())
    driver = Driver(sched)
    a, b = two_running(sched, driver)
    arrival = make_req("arrival", priority=priority, max_new=3)
    sched.add_request(arrival)
    driver.step()
    assert (arrival in sched.running) is preempts
    assert sum(sched.priority.preemptions.values()) == int(preempts)
    driver.finish()
    assert driver.admitted[:3] == ["a", "b", "arrival"]
    assert_outputs_as_alone(a, b, arrival)


def test_equal_importance_never_preempts_even_at_threshold_zero() -> None:
    sched = Scheduler(priority_config(preemption_threshold=0))
    driver = Driver(sched)
    two_running(sched, driver, first=4, second=4)
    same = make_req("same", priority=4)
    sched.add_request(same)
    driver.step()
    assert same in sched.waiting and not sched.priority.preemptions
    above = make_req("above", priority=5)
    sched.add_request(above)
    driver.step()
    assert above in sched.running and sched.priority.preemptions == {4: 1}
    driver.finish()


def test_low_values_first_preempts_the_largest_value() -> None:
    sched = Scheduler(priority_config(low_priority_values_first=True))
    driver = Driver(sched)
    a, b = two_running(sched, driver, first=50, second=30)
    urgent = make_req("urgent", priority=0)
    sched.add_request(urgent)
    driver.step()
    assert sched.running == [b, urgent] and sched.priority.preemptions == {50: 1}
    driver.finish()
    assert_outputs_as_alone(a, b, urgent)


@pytest.mark.parametrize("overlap", [False, True])
def test_an_important_arrival_preempts_for_kv_room(overlap: bool) -> None:
    """Seats are free but the pool is not: the newest low request gives its KV back (kept
    as an evictable cached prefix) and resumes from it later."""
    cfg = priority_config(num_slots=64, max_running_requests=8, decode_reserve_ratio=0.0)
    sched = Scheduler(cfg)
    driver = Driver(sched, overlap)
    a, b = make_req("a", length=24, max_new=12), make_req("b", length=24, max_new=12)
    sched.add_request(a)
    sched.add_request(b)
    driver.step()
    driver.step()
    assert sched.running == [a, b] and sched.allocator.available() < 20
    high = make_req("high", priority=20, length=20, max_new=4)
    sched.add_request(high)
    batch = driver.step()
    assert batch is not None and [n.rid for n in batch.batch.new_requests] == ["high"]
    assert sched.running == [a, high] and b in sched.waiting
    assert sched.priority.preemptions == {0: 1}
    driver.finish()
    assert_outputs_as_alone(a, b, high)


def test_off_nothing_is_preempted_and_arrival_order_holds() -> None:
    sched = Scheduler(priority_config(enable_priority_scheduling=False))
    driver = Driver(sched)
    a, b = two_running(sched, driver)
    queued = make_req("q1")
    sched.add_request(queued)
    high = make_req("high", priority=100)
    sched.add_request(high)
    driver.finish()
    assert driver.admitted == ["a", "b", "q1", "high"]
    assert not sched.priority.preemptions and sched.stats()["num_preemptions"] == 0
    assert_outputs_as_alone(a, b, queued, high)


def test_random_priorities_under_memory_pressure_leak_nothing() -> None:
    cfg = priority_config(num_slots=160, max_running_requests=4, chunked_prefill_size=16,
                          page_size=2, decode_reserve_ratio=0.0)
    sched = Scheduler(cfg)
    driver = Driver(sched, overlap=True)
    reqs = [make_req(f"r{i}", priority=(i * 7) % 40, length=8 + i % 13, max_new=10 + i % 9)
            for i in range(24)]
    for i, r in enumerate(reqs):
        sched.add_request(r)
        if i % 3 == 2:
            driver.step()
    driver.finish()
    assert sum(sched.priority.preemptions.values()) > 0
    assert_outputs_as_alone(*reqs)


# ---- metrics --------------------------------------------------------------------------------


def test_priority_labels_keep_the_first_values_and_bucket_the_rest() -> None:
    label = PriorityLabels(limit=2)
    assert [label(p) for p in (5, -1, 5, 7, 8, -1)] == ["5", "-1", "5", OTHER_PRIORITY,
                                                         OTHER_PRIORITY, "-1"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_preemptions_and_queue_time_are_counted_by_priority() -> None:
    engine_id = f"priority-{next(_ids)}"
    labels = {"model_name": "m", "engine_id": engine_id}
    clock = FakeClock()
    metrics = SchedulerMetrics(engine_id, clock)
    metrics.start("m", 1024)
    sched = Scheduler(priority_config())
    driver = Driver(sched)
    reqs = [make_req("a", max_new=20), make_req("b", max_new=20)]
    for r in reqs:
        metrics.queued(r)
        sched.add_request(r)
    clock.now += 1.0
    metrics.admitted(driver.step())  # type: ignore[arg-type]
    high = make_req("high", priority=20, max_new=3)
    metrics.queued(high)
    sched.add_request(high)
    clock.now += 0.5
    metrics.admitted(driver.step())  # type: ignore[arg-type]
    metrics.state(sched)
    metrics.state(sched)  # counted once
    while sched.has_work():
        batch = driver.step()
        if batch is not None:
            metrics.admitted(batch)  # b's readmission is not a second wait

    def sample(name: str, priority: str) -> float | None:
        return REGISTRY.get_sample_value(name, {**labels, "priority": priority})

    assert sample("radixmesh:num_preempted_requests_total", "0") == 1
    assert sample("radixmesh:queue_time_seconds_count", "0") == 2
    assert sample("radixmesh:queue_time_seconds_sum", "0") == 2.0
    assert sample("radixmesh:queue_time_seconds_count", "20") == 1
    assert sample("radixmesh:queue_time_seconds_sum", "20") == 0.5


# ---- the in-process engine ------------------------------------------------------------------

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def priority_engine() -> Iterator[object]:
    from radixmesh.api import Engine

    eng = Engine(dtype="float32", max_total_tokens=2048, max_running_requests=2,
                 enable_priority_scheduling=True, show_progress=False, random_seed=0)
    yield eng
    eng.shutdown()


def test_engine_admits_an_important_request_first_and_the_preempted_one_is_unchanged(
    priority_engine: object,
) -> None:
    engine = priority_engine
    sched = engine.scheduler  # type: ignore[attr-defined]
    prompts = {
        "low1": "The history of the printing press begins",
        "low2": "A recipe for bread needs flour, water,",
        "low3": "The tallest mountains on Earth are",
        "low4": "Photosynthesis is the process by which",
        "high": "The three primary colors are",
    }
    # low1 runs longest, so that it still runs when high arrives.
    params = {rid: {**GREEDY, "max_new_tokens": 40 if rid == "low1" else 12} for rid in prompts}
    alone = {rid: engine.generate(text, params[rid])["output_ids"]  # type: ignore[attr-defined]
             for rid, text in prompts.items()}
    assert engine.flush_cache()  # type: ignore[attr-defined]
    admitted: list[str] = []
    schedule = sched.schedule

    def noting_admissions() -> ScheduledBatch | None:
        batch = schedule()
        if batch is not None:
            admitted.extend(n.rid for n in batch.batch.new_requests)
        return batch

    sched.schedule = noting_admissions
    try:
        outputs: dict[str, list[int]] = {}

        def consume(rid: str, chunks: Iterator[dict]) -> None:
            for chunk in chunks:  # each carries the new ids only
                outputs.setdefault(rid, []).extend(chunk["output_ids"])

        def start(rid: str, priority: int = 0) -> Iterator[dict]:
            return engine.generate(  # type: ignore[attr-defined]
                prompts[rid], params[rid], rid=rid, priority=priority, stream=True
            )

        running = [start("low1"), start("low2")]
        for rid, stream in zip(("low1", "low2"), running, strict=True):
            outputs[rid] = list(next(stream)["output_ids"])  # prefilled: the batch is full
        rest = {rid: start(rid) for rid in ("low3", "low4")}
        rest["high"] = start("high", priority=20)
        threads = [threading.Thread(target=consume, args=(rid, s))
                   for rid, s in [("low1", running[0]), ("low2", running[1]), *rest.items()]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        del sched.schedule
    first = [rid for i, rid in enumerate(admitted) if rid not in admitted[:i]]
    assert first == ["low1", "low2", "high", "low3", "low4"]
    assert admitted.count("low2") == 2  # preempted, then readmitted from its cached prefix
    assert sched.priority.preemptions[0] >= 1
    assert outputs == alone


def test_engine_refuses_a_priority_that_is_not_an_integer(priority_engine: object) -> None:
    with pytest.raises(RequestError, match="priority") as err:
        priority_engine.generate("Hi", {"max_new_tokens": 1}, priority="high")  # type: ignore
    assert err.value.field == "priority"
