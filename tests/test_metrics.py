"""Each service's metrics recorder, without sockets: exact counts from known events."""

from __future__ import annotations

import itertools

import pytest
from fake_worker import FakeWorker
from prometheus_client import REGISTRY

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.sampling_params import SamplingParams
from radixmesh.core.step import StepBatch, StepEntry, int_array
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler import Scheduler
from radixmesh.engine.scheduler_config import SchedulerConfig
from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.services.detokenizer import metrics as detok_metrics
from radixmesh.services.scheduler.metrics import SchedulerMetrics, ThroughputMeter
from radixmesh.services.tokenizer.generation import GenerationChunk
from radixmesh.services.tokenizer.metrics import (
    INTER_TOKEN_LATENCY,
    TokenizerMetrics,
    observe_each,
)
from radixmesh.services.worker.metrics import WorkerMetrics, batch_tokens

_names = itertools.count()


def unique(prefix: str) -> str:
    """A label value no other test uses: the registry is shared by the whole process."""
    return f"{prefix}-{next(_names)}"


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def chunk(
    completion: int, cached: int = 0, finish: str | None = None, host: int = 0
) -> GenerationChunk:
    return GenerationChunk(
        rid="r", text="", output_ids=[], prompt_tokens=5, completion_tokens=completion,
        cached_tokens=cached, finish=FinishReason(FinishKind(finish)) if finish else None,
        cached_host_tokens=host,
    )


# ---- tokenizer --------------------------------------------------------------------------


def test_a_finished_request_settles_every_counter_at_its_last_chunk() -> None:
    model, clock = unique("tok"), FakeClock()
    req = TokenizerMetrics(model, clock).request(prompt_tokens=5)
    assert value("radixmesh:tokenizer_num_in_flight_reqs", model_name=model) == 1
    clock.now += 0.5
    req.on_chunk(chunk(1, cached=2))
    clock.now += 0.2
    req.on_chunk(chunk(3, cached=2))  # two tokens at once share the 0.2 s
    clock.now += 0.1
    req.on_chunk(chunk(3, cached=2, finish="length", host=1))
    assert value("radixmesh:prompt_tokens_total", model_name=model) == 5
    assert value("radixmesh:generation_tokens_total", model_name=model) == 3
    assert value("radixmesh:cached_tokens_total", model_name=model, tier="device") == 1
    assert value("radixmesh:cached_tokens_total", model_name=model, tier="host") == 1
    assert value("radixmesh:cached_tokens_total", model_name=model, tier="storage") == 0
    assert value("radixmesh:num_requests_total", model_name=model) == 1
    assert value("radixmesh:num_aborted_requests_total", model_name=model) == 0
    assert value("radixmesh:tokenizer_num_in_flight_reqs", model_name=model) == 0
    assert value("radixmesh:time_to_first_token_seconds_count", model_name=model) == 1
    assert value("radixmesh:time_to_first_token_seconds_sum", model_name=model) == 0.5
    assert value("radixmesh:inter_token_latency_seconds_count", model_name=model) == 2
    assert value("radixmesh:inter_token_latency_seconds_sum", model_name=model) == pytest.approx(
        0.2
    )
    assert value("radixmesh:e2e_request_latency_seconds_count", model_name=model) == 1
    assert value("radixmesh:e2e_request_latency_seconds_sum", model_name=model) == pytest.approx(
        0.8
    )
    req.close()  # the generator's cleanup after the last chunk counts nothing twice
    assert value("radixmesh:num_requests_total", model_name=model) == 1
    assert value("radixmesh:tokenizer_num_in_flight_reqs", model_name=model) == 0


@pytest.mark.parametrize("share", [0.0005, 0.002, 0.0049, 0.005, 0.3, 5, 7.5])
def test_observations_at_once_are_those_of_observe_called_for_each(share: float) -> None:
    """observe_each records what `count` observe() calls would: bucket counts, count and
    sum, a value on a bucket's bound included."""
    model = unique("itl")
    one, many = (INTER_TOKEN_LATENCY.labels(model_name=f"{model}-{k}") for k in ("a", "b"))
    for _ in range(64):
        one.observe(share)
    observe_each(many, share, 64)

    def samples(name: str) -> dict[tuple[str, str], float]:
        return {(s.name, s.labels.get("le", "")): s.value
                for family in INTER_TOKEN_LATENCY.collect() for s in family.samples
                if s.labels["model_name"] == name and not s.name.endswith("_created")}

    one_samples, many_samples = samples(f"{model}-a"), samples(f"{model}-b")
    total = ("radixmesh:inter_token_latency_seconds_sum", "")
    assert many_samples.pop(total) == pytest.approx(one_samples.pop(total))
    assert many_samples == one_samples  # every bucket, and the count
    assert value("radixmesh:inter_token_latency_seconds_count", model_name=f"{model}-b") == 64


def test_a_hang_up_is_an_abort_with_the_tokens_delivered_so_far() -> None:
    model = unique("tok")
    req = TokenizerMetrics(model, FakeClock()).request(prompt_tokens=7)
    req.on_chunk(chunk(4, cached=6))
    req.close()
    assert value("radixmesh:generation_tokens_total", model_name=model) == 4
    assert value("radixmesh:cached_tokens_total", model_name=model, tier="device") == 6
    assert value("radixmesh:num_requests_total", model_name=model) == 1
    assert value("radixmesh:num_aborted_requests_total", model_name=model) == 1
    assert value("radixmesh:e2e_request_latency_seconds_count", model_name=model) == 0
    assert value("radixmesh:tokenizer_num_in_flight_reqs", model_name=model) == 0


def test_a_stop_string_trims_the_counted_tokens_and_an_engine_abort_counts() -> None:
    model = unique("tok")
    metrics = TokenizerMetrics(model, FakeClock())
    stopped = metrics.request(prompt_tokens=3)
    stopped.on_chunk(chunk(4))
    stopped.on_chunk(chunk(3, finish="stop"))
    refused = metrics.request(prompt_tokens=2)
    refused.on_chunk(chunk(0, finish="abort"))
    assert value("radixmesh:generation_tokens_total", model_name=model) == 3
    assert value("radixmesh:num_requests_total", model_name=model) == 2
    assert value("radixmesh:num_aborted_requests_total", model_name=model) == 1
    # A request that never produced a token has no time to first token.
    assert value("radixmesh:time_to_first_token_seconds_count", model_name=model) == 1
    assert value("radixmesh:e2e_request_latency_seconds_count", model_name=model) == 2


# ---- scheduler --------------------------------------------------------------------------


def test_throughput_is_tokens_over_the_interval_since_the_last_reading() -> None:
    clock = FakeClock()
    meter = ThroughputMeter(clock)
    meter.add(30)
    clock.now += 2
    assert meter.read() == 15
    clock.now += 1
    assert meter.read() == 0
    assert meter.read() == 0  # no time passed: no rate, no division by zero


def _req(rid: str, prompt: list[int], max_new: int) -> Req:
    return Req(rid=rid, input_ids=prompt, params=SamplingParams(max_new_tokens=max_new), seed=0)


class Engine:
    """Steps a scheduler and reports to its metrics the way the scheduler service does."""

    def __init__(self, metrics: SchedulerMetrics, num_slots: int) -> None:
        self.metrics = metrics
        self.sched = Scheduler(SchedulerConfig(num_slots=num_slots))
        self.worker = FakeWorker(num_slots)
        self.sent: dict[str, int] = {}  # output tokens reported, by request

    def add(self, req: Req) -> None:
        self.sched.add_request(req)

    def step(self) -> None:
        batch = self.sched.schedule()
        assert batch is not None
        self.metrics.batch(batch.batch.num_tokens, batch.batch.num_requests)
        self.sched.process_result(batch, self.worker.forward(batch.batch))
        for req in self.sched.drain_updates():
            first = req.rid not in self.sent
            new = len(req.output_ids) - self.sent.get(req.rid, 0)
            self.sent[req.rid] = len(req.output_ids)
            finish = req.finish.kind.value if req.finish is not None else None
            self.metrics.update(first, len(req.input_ids), req.cached_tokens, new, finish)
        self.metrics.state(self.sched)


def test_scheduler_counts_tokens_hits_batches_and_pool_state() -> None:
    engine_id = unique("engine")
    labels = {"model_name": "m", "engine_id": engine_id}
    metrics = SchedulerMetrics(engine_id)
    metrics.start("m", 256)
    engine = Engine(metrics, 256)
    sched = engine.sched
    for rid in ("a", "b"):
        engine.add(_req(rid, list(range(10)), max_new=3))
        engine.step()  # the prefill: running, holding slots
        assert value("radixmesh:num_running_reqs", **labels) == 1
        assert value("radixmesh:num_queue_reqs", **labels) == 0
        while sched.has_work():
            engine.step()
    metrics.refused()
    assert value("radixmesh:max_total_num_tokens", **labels) == 256
    assert value("radixmesh:scheduler_prompt_tokens_total", **labels) == 20
    assert value("radixmesh:scheduler_generation_tokens_total", **labels) == 6
    assert value("radixmesh:scheduler_cached_tokens_total", **labels, tier="device") == 9
    assert value("radixmesh:cache_hit_rate", **labels) == 9 / 20
    assert value(
        "radixmesh:scheduler_finished_requests_total", **labels, finish_reason="length"
    ) == 2
    assert value("radixmesh:scheduler_refused_requests_total", **labels) == 1
    # a: 10 prompt tokens then 2 decodes; b: 1 uncached prompt token then 2 decodes.
    assert value("radixmesh:scheduler_batch_tokens_sum", **labels) == 10 + 2 + 1 + 2
    assert value("radixmesh:scheduler_batch_reqs_sum", **labels) == 6
    assert value("radixmesh:scheduler_batch_reqs_count", **labels) == 6  # release-only skipped
    assert value("radixmesh:num_running_reqs", **labels) == 0
    used = 256 - sched.allocator.available()
    assert used == sched.cache.total_size() == 12  # the prompt and two fed-back outputs
    assert value("radixmesh:num_used_tokens", **labels) == used
    assert value("radixmesh:token_usage", **labels) == used / 256
    assert value("radixmesh:scheduler_cache_tokens", **labels, tier="device") == used
    assert value("radixmesh:num_retracted_requests_total", **labels) == 0


def test_retractions_and_forced_tokens_are_counted_once_each() -> None:
    engine = unique("engine")
    labels = {"model_name": "m", "engine_id": engine}
    metrics = SchedulerMetrics(engine)
    metrics.start("m", 64)
    sched = Scheduler(SchedulerConfig(num_slots=64))
    sched.num_retractions, sched.constraints.forced_tokens = 2, 10
    metrics.state(sched)
    metrics.state(sched)
    sched.num_retractions, sched.constraints.forced_tokens = 3, 14
    metrics.state(sched)
    assert value("radixmesh:num_retracted_requests_total", **labels) == 3
    assert value("radixmesh:jump_forward_tokens_total", **labels) == 14


def test_speculation_counts_verify_steps_and_the_mean_accept_length() -> None:
    engine = unique("engine")
    labels = {"model_name": "m", "engine_id": engine}
    metrics = SchedulerMetrics(engine)
    metrics.start("m", 64)
    sched = Scheduler(SchedulerConfig(num_slots=64))
    stats = sched.speculation.stats
    stats.verify_steps, stats.accepted_tokens = 4, 6
    metrics.state(sched)
    metrics.state(sched)
    stats.verify_steps, stats.accepted_tokens = 10, 20
    metrics.state(sched)
    assert value("radixmesh:spec_verify_steps_total", **labels) == 10
    assert value("radixmesh:spec_accepted_tokens_total", **labels) == 20
    assert value("radixmesh:spec_accept_length", **labels) == 3.0  # (20 + 10) / 10


# ---- worker and detokenizer ---------------------------------------------------------------


def test_worker_counts_every_step_and_sizes_the_ones_that_compute() -> None:
    rank = 7  # no other test runs a rank 7
    labels = {"model_name": "m", "tp_rank": str(rank)}
    metrics = WorkerMetrics(rank)
    metrics.loaded("m", 496)
    batch = StepBatch(1, entries=[
        StepEntry("a", [1, 2, 3, 4, 5], [0, 1, 2, 3, 4], True),
        StepEntry("b", [], [9], True),  # a decode: one token, no ids
    ], decode_rows=int_array([3]), decode_slots=int_array([12]))  # a packed decode
    assert batch_tokens(batch) == 7
    metrics.forward(batch, forward_ms=20)
    metrics.forward(StepBatch(2, release=["a"]), forward_ms=1)
    assert value("radixmesh:worker_kv_pool_tokens", **labels) == 496
    assert value("radixmesh:worker_forward_seconds_count", **labels) == 2
    assert value("radixmesh:worker_forward_seconds_sum", **labels) == pytest.approx(0.021)
    assert value("radixmesh:worker_batch_tokens_sum", **labels) == 7
    assert value("radixmesh:worker_batch_reqs_sum", **labels) == 3
    assert value("radixmesh:worker_batch_reqs_count", **labels) == 1


def test_detokenizer_counts_updates_tokens_and_finished_requests() -> None:
    names = ("updates", "tokens", "finished_requests")
    before = {n: value(f"radixmesh:detokenizer_{n}_total") or 0 for n in names}
    step = mpb.TokenStep()
    step.updates.add(rid="a", new_ids=[1, 2])
    step.updates.add(rid="b", new_ids=[3], finish=mpb.Finish(kind="length"))
    step.packed.rids.extend(["c", "d"])  # packed: new ids alone, never a finish
    step.packed.new_ids = int_array([4, 5, 6]).tobytes()
    detok_metrics.observe_step(step)
    after = {n: value(f"radixmesh:detokenizer_{n}_total") for n in names}
    assert {n: after[n] - before[n] for n in names} == {  # type: ignore[operator]
        "updates": 4, "tokens": 6, "finished_requests": 1,
    }
