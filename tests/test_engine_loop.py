"""The engine loop against a model-free worker: overlap on and off give the same tokens, and
losing the model runners mid-step ends every request with the reason, drops the cache and
starts over (steps from 1) once the runners are back."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest
from fake_worker import FakeWorker, reference_output

from radixmesh.core.finish import FinishKind
from radixmesh.core.sampling_params import SamplingParams
from radixmesh.core.step import StepResult
from radixmesh.engine.loop import EngineLoop, ExecutorLost
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler import ScheduledBatch, Scheduler
from radixmesh.engine.scheduler_config import SchedulerConfig

SLOTS = 512


class Runners:
    """The executor: a FakeWorker that, with `die_at`, fails that step (and every step after
    it until `back()`), as a dead worker's gRPC calls do."""

    def __init__(self, die_at: int = 0) -> None:
        self.worker = FakeWorker(SLOTS)
        self.die_at = die_at
        self.dead = False
        self.steps: list[int] = []

    def submit(self, batch: ScheduledBatch) -> Awaitable[StepResult]:
        async def run() -> StepResult:
            await asyncio.sleep(0)
            self.steps.append(batch.batch.step)
            if len(self.steps) == self.die_at:
                self.dead = True
            if self.dead:
                raise ExecutorLost("engine e0 lost its worker (UNAVAILABLE: gone)")
            return self.worker.forward(batch.batch)

        return asyncio.ensure_future(run())

    def back(self) -> None:
        self.dead = False
        self.worker = FakeWorker(SLOTS)  # a fresh process: nothing of the old one


class Sink:
    def __init__(self) -> None:
        self.finished: dict[str, Req] = {}

    def refuse(self, req: Req, error: Exception) -> None:
        raise AssertionError(f"refused {req.rid}: {error}")

    async def publish(self, updated: list[Req]) -> None:
        for req in updated:
            if req.finish is not None:
                self.finished[req.rid] = req


def request(rid: str, prompt: list[int], max_new: int = 12) -> Req:
    return Req(rid=rid, input_ids=prompt, params=SamplingParams(max_new_tokens=max_new), seed=0)


async def serve(loop: EngineLoop, sink: Sink, reqs: list[Req]) -> None:
    for req in reqs:
        loop.add(req)
    while not all(r.rid in sink.finished for r in reqs):
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("overlap", [False, True])
def test_losing_the_runners_ends_every_request_then_serves_again(overlap: bool) -> None:
    async def scenario() -> None:
        runners, sink = Runners(die_at=4), Sink()
        sched = Scheduler(SchedulerConfig(num_slots=SLOTS))
        lost: list[str] = []

        async def on_lost(exc: ExecutorLost) -> None:
            lost.append(str(exc))
            assert not sched.requests and sched.cache.total_size() == 0
            runners.back()

        loop = EngineLoop(sched, runners, sink, overlap, on_lost=on_lost)
        running = asyncio.create_task(loop.run())
        first = [request(f"a{i}", [1, 2, 3, i]) for i in range(3)]
        await serve(loop, sink, first)
        assert lost == ["engine e0 lost its worker (UNAVAILABLE: gone)"]
        for req in first:
            assert req.finish is not None and req.finish.kind is FinishKind.ABORT
            assert req.finish.message == lost[0]
        # Back: the next step is step 1 again, and a request runs as on a fresh engine.
        before = len(runners.steps)
        again = request("b", [1, 2, 3, 0])
        await serve(loop, sink, [again])
        assert runners.steps[before] == 1
        assert again.output_ids == reference_output([1, 2, 3, 0], 12)
        assert again.cached_tokens == 0  # the cache went with the runners
        sched.check_invariants()
        assert sched.held_slots() == 0
        loop.stop()
        await running

    asyncio.run(scenario())


def test_a_loss_noticed_between_steps_starts_over_too() -> None:
    async def scenario() -> None:
        runners, sink = Runners(), Sink()
        sched = Scheduler(SchedulerConfig(num_slots=SLOTS))
        lost: list[str] = []

        async def on_lost(exc: ExecutorLost) -> None:
            lost.append(str(exc))
            runners.back()

        loop = EngineLoop(sched, runners, sink, True, on_lost=on_lost)
        running = asyncio.create_task(loop.run())
        warm = request("warm", [5, 6, 7], max_new=2)
        await serve(loop, sink, [warm])
        assert sched.cache.total_size() > 0
        loop.lose(ExecutorLost("engine e0 lost its worker (UNAVAILABLE)"))
        while not lost:
            await asyncio.sleep(0.001)
        assert sched.cache.total_size() == 0
        after = request("after", [5, 6, 7], max_new=2)
        await serve(loop, sink, [after])
        assert after.cached_tokens == 0 and after.output_ids == warm.output_ids
        loop.stop()
        await running

    asyncio.run(scenario())


def test_without_a_hook_a_lost_executor_stops_the_loop() -> None:
    async def scenario() -> None:
        runners, sink = Runners(die_at=1), Sink()
        loop = EngineLoop(Scheduler(SchedulerConfig(num_slots=SLOTS)), runners, sink)
        running = asyncio.create_task(loop.run())
        loop.add(request("x", [1, 2]))
        with pytest.raises(ExecutorLost):
            await running

    asyncio.run(scenario())
