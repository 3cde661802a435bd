"""The scheduler service over real NATS and real gRPC, with a model-free worker."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import nats
import pytest
from fake_worker import FakeWorker, reference_output

from radixmesh.core.service_settings import SchedulerServiceConfig
from radixmesh.mesh import subjects
from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.proto import worker_pb2 as wpb
from radixmesh.proto import worker_pb2_grpc as wgrpc
from radixmesh.proto.convert import batch_from_proto, packed_updates, result_to_proto
from radixmesh.services.scheduler.server import SchedulerService

NUM_SLOTS = 256
REPLY = "rm.tokenizer.test.out"
# The fake worker says it serves a mixture of experts.
MOE_SHAPE = {"architecture": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2}


class FakeWorkerServicer(wgrpc.WorkerServicer):
    def __init__(self) -> None:
        self.worker = FakeWorker(NUM_SLOTS)

    async def Steps(self, requests: AsyncIterator[wpb.StepBatch], context: object
                    ) -> AsyncIterator[wpb.StepResult]:
        # With overlap, step N+1 is on the stream before N's result is read.
        async for request in requests:
            await asyncio.sleep(0.002)  # a step takes time, so steps overlap
            yield result_to_proto(self.worker.forward(batch_from_proto(request)))

    async def GetInfo(self, request: wpb.WorkerInfoRequest, context: object) -> wpb.WorkerInfo:
        return wpb.WorkerInfo(
            num_slots=NUM_SLOTS, vocab_size=50, max_position_embeddings=200, tp_size=1,
            model_path="fake", dtype="float32", **MOE_SHAPE,
        )


@asynccontextmanager
async def mesh(nats_url: str, overlap: bool = True) -> AsyncIterator[tuple[SchedulerService,
                                                                           nats.NATS]]:
    server = grpc.aio.server()
    wgrpc.add_WorkerServicer_to_server(FakeWorkerServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    service = SchedulerService(
        SchedulerServiceConfig(
            nats_url=nats_url, engine_id="e1", worker_addrs=f"127.0.0.1:{port}",
            disable_overlap_schedule=not overlap, max_running_requests=8, chunked_prefill_size=16,
        )
    )
    await service.start()
    stop = asyncio.Event()
    running = asyncio.create_task(service.run(stop))
    nc = await nats.connect(nats_url)
    try:
        yield service, nc
    finally:
        await nc.close()
        stop.set()
        await running
        await server.stop(None)


def request(rid: str, prompt: list[int], max_new: int, **kw: object) -> bytes:
    msg = mpb.EngineRequest(rid=rid, input_ids=prompt, reply_to=REPLY, detok_context=3, **kw)
    msg.sampling.max_new_tokens = max_new
    msg.sampling.temperature = 0
    msg.sampling.top_p = 1
    msg.sampling.ignore_eos = True
    msg.sampling.repetition_penalty = 1
    return msg.SerializeToString()


def step_updates(step: mpb.TokenStep) -> list[mpb.TokenUpdate]:
    """A step's updates, its packed ones as TokenUpdates."""
    p = step.packed
    return [*step.updates, *(
        mpb.TokenUpdate(rid=u.rid, seq=u.seq, offset=u.offset, context_ids=u.context,
                        new_ids=u.new, reply_to=p.reply_to[u.route], detok=p.detok[u.route],
                        engine_id=step.engine_id)
        for u in packed_updates(p))]


async def collect(nc: nats.NATS, rids: set[str]) -> tuple[dict[str, list[mpb.TokenUpdate]],
                                                          asyncio.Event, object]:
    updates: dict[str, list[mpb.TokenUpdate]] = {r: [] for r in rids}
    done = asyncio.Event()

    async def on_step(msg: object) -> None:
        for u in step_updates(mpb.TokenStep.FromString(msg.data)):  # type: ignore[attr-defined]
            updates.setdefault(u.rid, []).append(u)
        if all(u and u[-1].HasField("finish") for u in updates.values()):
            done.set()

    sub = await nc.subscribe(subjects.DETOK, queue=subjects.DETOK_QUEUE, cb=on_step)
    return updates, done, sub


@pytest.mark.parametrize("overlap", [True, False])
def test_requests_stream_exact_tokens_in_order(nats_url, overlap):
    async def run() -> None:
        async with mesh(nats_url, overlap) as (service, nc):
            prompts = {f"r{i}": [1 + i, 2, 3, 4, 5, 6, 7, 8] * (i + 1) for i in range(6)}
            updates, done, _ = await collect(nc, set(prompts))
            for rid, prompt in prompts.items():
                await nc.publish(subjects.engine_generate("e1"), request(rid, prompt, 12))
            await asyncio.wait_for(done.wait(), 20)
            for rid, prompt in prompts.items():
                ups = updates[rid]
                assert [u.seq for u in ups] == list(range(len(ups)))
                assert [u.offset for u in ups] == sorted(u.offset for u in ups)
                out = [t for u in ups for t in u.new_ids]
                assert out == reference_output(prompt, 12)
                assert ups[-1].finish.kind == "length" and ups[-1].finish.token_id == 12
                assert all(u.reply_to == REPLY and u.engine_id == "e1" for u in ups)
                # Each update carries the 3 tokens before its new ids as context.
                for u in ups:
                    seq = prompt + out
                    before = seq[: len(prompt) + u.offset]
                    assert list(u.context_ids) == before[-3:]
            info = json.loads((await nc.request(
                subjects.engine_control("e1"), b'{"op": "info"}', timeout=5)).data)
            assert info["held_slots"] == 0 and info["running"] == 0
            assert info["cached_tokens"] > 0
            service.scheduler.check_invariants()

    asyncio.run(run())


def test_info_and_heartbeat_carry_the_model_shape(nats_url):
    async def run() -> None:
        async with mesh(nats_url) as (_, nc):
            heard: asyncio.Queue[mpb.EngineStatus] = asyncio.Queue()

            async def on_status(msg: object) -> None:
                heard.put_nowait(mpb.EngineStatus.FromString(msg.data))  # type: ignore[attr-defined]

            await nc.subscribe(subjects.ENGINES, cb=on_status)
            status = await asyncio.wait_for(heard.get(), 5)
            assert {k: getattr(status, k) for k in MOE_SHAPE} == MOE_SHAPE
            info = json.loads((await nc.request(
                subjects.engine_control("e1"), b'{"op": "info"}', timeout=5)).data)
            assert {k: info[k] for k in MOE_SHAPE} == MOE_SHAPE

    asyncio.run(run())


def test_repeat_hits_cache_and_cache_events_flow(nats_url):
    async def run() -> None:
        async with mesh(nats_url) as (service, nc):
            events: list[mpb.CacheEvent] = []

            async def on_event(msg: object) -> None:
                events.append(mpb.CacheEvent.FromString(msg.data))  # type: ignore[attr-defined]

            await nc.subscribe(subjects.CACHE_EVENTS_ALL, cb=on_event)
            prompt = list(range(1, 41))
            for rid in ("a", "b"):
                updates, done, sub = await collect(nc, {rid})
                await nc.publish(subjects.engine_generate("e1"), request(rid, prompt, 4))
                await asyncio.wait_for(done.wait(), 20)
                await sub.unsubscribe()
            assert updates["b"][0].cached_tokens == 39  # all but the last prompt token
            await nc.flush()
            seqs = [list(s.token_ids) for e in events for s in e.inserted]
            assert prompt + reference_output(prompt, 4) in seqs
            reply = await nc.request(subjects.engine_control("e1"), b'{"op": "flush"}', timeout=5)
            assert json.loads(reply.data) == {"success": True}
            await asyncio.sleep(0.05)
            assert any(e.flushed for e in events)

    asyncio.run(run())


def test_abort_and_refusal(nats_url):
    async def run() -> None:
        async with mesh(nats_url) as (service, nc):
            updates, done, _ = await collect(nc, {"long", "huge", "stopped"})
            await nc.publish(subjects.engine_generate("e1"), request("long", [1, 2, 3], 150))
            await nc.publish(subjects.engine_generate("e1"), request("huge", [1] * 300, 4))
            await nc.publish(subjects.engine_generate("e1"), request("stopped", [4, 5], 150))
            while len(updates["long"]) < 3 or len(updates["stopped"]) < 2:
                await asyncio.sleep(0.01)
            await nc.publish(subjects.engine_abort("e1"), mpb.AbortRequest(rid="long")
                             .SerializeToString())
            stop = mpb.AbortRequest(rid="stopped", finish=mpb.Finish(kind="stop", text="</s>"))
            await nc.publish(subjects.engine_abort("e1"), stop.SerializeToString())
            await asyncio.wait_for(done.wait(), 20)
            assert updates["long"][-1].finish.kind == "abort"
            assert updates["stopped"][-1].finish.kind == "stop"
            assert updates["stopped"][-1].finish.text == "</s>"
            refused = updates["huge"]
            assert len(refused) == 1 and refused[0].finish.kind == "abort"
            assert "context length" in refused[0].finish.message
            await asyncio.sleep(0.05)
            info = json.loads((await nc.request(
                subjects.engine_control("e1"), b'{"op": "info"}', timeout=5)).data)
            assert info["held_slots"] == 0 and info["running"] == 0 and info["waiting"] == 0
            service.scheduler.check_invariants()

    asyncio.run(run())


def test_steps_after_a_lost_worker_go_out_in_order_on_one_new_stream(monkeypatch) -> None:
    """The overlap loop sends step 2 before step 1 is back. When the first of them finds the
    stream failed (the worker restarted), both must go out on one new stream, 1 then 2: a
    worker that saw step 2 first would decode a request it has not been given."""
    from radixmesh.core.step import StepBatch
    from radixmesh.services.scheduler import worker_link

    sent: list[tuple[int, int]] = []  # (stream, step), in the order written

    class Stream:
        opened = 0

        def __init__(self, stub: object) -> None:
            Stream.opened += 1
            self.id, self.failed = Stream.opened, None

        async def step(self, msg: wpb.StepBatch) -> wpb.StepResult:
            sent.append((self.id, msg.step))
            await asyncio.sleep(0)
            return wpb.StepResult(step=msg.step)

        async def close(self) -> None:
            await asyncio.sleep(0.01)  # a failed call takes a moment to wind down

    monkeypatch.setattr(worker_link, "StepStream", Stream)

    async def run() -> None:
        client = worker_link.WorkerClient(["127.0.0.1:1"])
        lost = Stream(None)
        lost.failed = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), "worker gone")
        client._streams = [lost]  # type: ignore[list-item]
        first = asyncio.ensure_future(client.forward(StepBatch(1)))
        second = asyncio.ensure_future(client.forward(StepBatch(2)))
        assert [r.step for r in await asyncio.gather(first, second)] == [1, 2]
        await client.close()

    asyncio.run(run())
    assert sent == [(2, 1), (2, 2)]
