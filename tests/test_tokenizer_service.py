"""The tokenizer's mesh client and routing against fake engines on a real NATS server, and
the service's process lifecycle. Its public gRPC port: test_grpc_front_door.py."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
from contextlib import aclosing

import aiohttp
import pytest
from fake_engine import FakeEngine, echo_ids, host_part, input_logprob, output_logprob, token_text
from process_helpers import service_process

from radixmesh.core.detokenize import detok_context_size
from radixmesh.core.finish import FinishKind
from radixmesh.core.meta_info import CachedTokens
from radixmesh.core.request import GenerationRequest
from radixmesh.core.sampling_params import LogprobRequest, SamplingParams
from radixmesh.core.service_settings import TokenizerServiceConfig
from radixmesh.core.step import int_array
from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.proto.convert import PackedChunk
from radixmesh.services.tokenizer import flights as flights_module
from radixmesh.services.tokenizer.assembler import ChunkAssembler, InFlight
from radixmesh.services.tokenizer.client import MeshClient
from radixmesh.services.tokenizer.generation import GenerationChunk, GenerationError
from radixmesh.services.tokenizer.server import TokenizerServer, public_args

pytestmark = pytest.mark.anyio


class Mesh:
    """A MeshClient plus the fake engines it routes to, all on one NATS connection."""

    def __init__(self, nc, tokenizer, engine_timeout_s: float = 3.0) -> None:
        self.nc = nc
        self.client = MeshClient(nc, tokenizer, "fake-model", os.urandom(6).hex(),
                                 engine_timeout_s=engine_timeout_s)
        self.engines: list[FakeEngine] = []

    async def add_engine(self, name: str, **options) -> FakeEngine:
        engine = await FakeEngine(self.nc, f"{name}-{os.urandom(3).hex()}", **options).start()
        self.engines.append(engine)
        await self.client.wait_for_engines(len(self.engines))
        return engine

    async def close(self) -> None:
        for engine in self.engines:
            await engine.stop()
        await self.client.close()


@pytest.fixture
async def mesh(nc, tokenizer):
    m = Mesh(nc, tokenizer)
    await m.client.start()
    yield m
    await m.close()


def _request(ids: list[int], rid: str | None = None, **params) -> GenerationRequest:
    return GenerationRequest(rid or os.urandom(8).hex(), ids, SamplingParams(**params))


async def _run(client: MeshClient, request: GenerationRequest) -> list[GenerationChunk]:
    async with aclosing(client.generate(request)) as chunks:
        return [chunk async for chunk in chunks]


def _ids(chunks: list[GenerationChunk]) -> list[int]:
    """The output ids of a request's chunks (those that came together arrive as one)."""
    ids = [t for c in chunks for t in c.output_ids]
    counts = [c.completion_tokens for c in chunks]
    assert counts == list(itertools.accumulate(len(c.output_ids) for c in chunks)), counts
    return ids


# ---- the mesh client ---------------------------------------------------------------------


async def test_single_request_round_trip(mesh):
    engine = await mesh.add_engine("e")
    prompt = [5, 6, 7, 8, 9]
    request = _request(prompt, max_new_tokens=3, stop=["xy"], temperature=0.5)
    chunks = await _run(mesh.client, request)
    assert "".join(c.text for c in chunks) == "".join(map(token_text, echo_ids(prompt, 3)))
    assert _ids(chunks) == [5, 6, 7]
    assert chunks[-1].finish.to_dict() == {"type": "length", "length": 3}
    assert all(c.finish is None for c in chunks[:-1])
    assert chunks[-1].prompt_tokens == 5
    sent = engine.requests[0]
    assert sent.rid == request.rid and list(sent.input_ids) == prompt
    assert sent.reply_to == f"rm.tokenizer.{mesh.client.replica_id}.out"
    assert sent.sampling.max_new_tokens == 3
    assert sent.sampling.temperature == 0.5 and 0 <= sent.sampling.seed < 2**63
    assert list(sent.detok.stop) == ["xy"] and list(sent.detok.prompt_tail) == [6, 7, 8, 9]
    assert sent.detok.skip_special_tokens and sent.detok_context == detok_context_size(["xy"])
    assert mesh.client.in_flight == 0 and engine.aborts == []


async def test_given_seed_is_kept(mesh):
    engine = await mesh.add_engine("e")
    await _run(mesh.client, _request([1, 2], max_new_tokens=1, seed=1234))
    assert engine.requests[0].sampling.seed == 1234


async def test_packed_chunks_read_as_the_same_chunks_in_full(mesh):
    """Chunks of new text alone may come packed (PackedChunks): the same output, counts and
    finish, in order even when they come last first."""
    await mesh.add_engine("e", packed=True, reverse=True)
    prompt = [5, 6, 7, 8, 9]
    chunks = await _run(mesh.client, _request(prompt, max_new_tokens=6))
    assert _ids(chunks) == echo_ids(prompt, 6)
    assert "".join(c.text for c in chunks) == "".join(map(token_text, echo_ids(prompt, 6)))
    assert chunks[-1].finish.to_dict() == {"type": "length", "length": 6}
    assert all(c.prompt_tokens == 5 for c in chunks)


async def test_out_of_order_chunks_are_reassembled_and_a_late_finish_ignored(mesh):
    await mesh.add_engine("e", reverse=True, extra_finish=True)
    chunks = await _run(mesh.client, _request([3, 4, 5], max_new_tokens=5))
    assert _ids(chunks) == echo_ids([3, 4, 5], 5)
    assert chunks[-1].finish.to_dict() == {"type": "length", "length": 5}
    assert "LATE" not in "".join(c.text for c in chunks)


async def test_logprobs_pass_through_and_prompt_logprobs_arrive_complete_at_the_end(mesh):
    await mesh.add_engine("e")
    prompt = [11, 12, 13, 14, 15, 16]
    request = GenerationRequest("lp", prompt, SamplingParams(max_new_tokens=3),
                                LogprobRequest(True, 2, 0))
    chunks = await _run(mesh.client, request)
    assert [lp for c in chunks for lp in c.output_token_logprobs] == [
        (pytest.approx(output_logprob(i)), t, None) for i, t in enumerate(echo_ids(prompt, 3))
    ]
    assert chunks[0].output_top_logprobs[0] == [(-1.0, 11, None), (-2.0, 12, None)]
    assert len([top for c in chunks for top in c.output_top_logprobs]) == 3
    assert all(c.input_token_logprobs == [] for c in chunks[:-1])  # only the last has them
    last = chunks[-1]
    assert last.input_token_logprobs[0] == (None, 11, None)  # NaN -> None
    assert last.input_token_logprobs[1:] == [
        (pytest.approx(input_logprob(p)), prompt[p], None) for p in range(1, 6)
    ]
    assert last.input_top_logprobs[0] is None
    assert last.input_top_logprobs[3] == [(-1.0, 14, None), (-2.0, 15, None)]


async def test_chunks_that_arrive_before_the_reader_wakes_reach_it_as_one():
    """A reader behind its request's output (a busy front door) takes all of it in one go:
    one chunk with every new token, the latest counts, and the finish."""
    flight = InFlight("e", ChunkAssembler(_request([1, 2, 3], rid="t")))
    assembler = flight.assembler
    for seq, (token, text) in enumerate([(7, " a"), (8, " b"), (9, " c")]):
        finish = mpb.Finish(kind="length", token_id=3) if seq == 2 else None
        chunk = mpb.TextChunk(rid="t", seq=seq, text=text, output_ids=[token],
                              completion_tokens=seq + 1, cached_tokens=2, finish=finish)
        for out in assembler.add(chunk):
            flight.deliver(out)
    merged = await flight.take()
    assert (merged.text, merged.output_ids, merged.completion_tokens) == (" a b c", [7, 8, 9], 3)
    assert merged.cached_tokens == 2 and merged.finish.to_dict() == {"type": "length",
                                                                     "length": 3}
    assert flight.ready is None


async def test_packed_chunks_join_the_output_the_reader_has_not_taken():
    """New text and ids alone (packed) join what waits for the reader when they come in
    order; one that comes early waits for the gap to fill; with nothing waiting, a chunk of
    its own with the request's counts."""
    flight = InFlight("e", ChunkAssembler(_request([1, 2, 3], rid="t")))
    first = mpb.TextChunk(rid="t", seq=0, text=" a", output_ids=[7], completion_tokens=1,
                          cached_tokens=2)
    flight.arrived(flight.assembler.add(first), 1.0)
    flight.packed(PackedChunk("t", 1, " b", int_array([8]), 2), 2.0)
    waiting = flight.ready
    assert waiting is not None and (waiting.text, waiting.completion_tokens) == (" a b", 2)
    flight.packed(PackedChunk("t", 3, " d", int_array([10]), 4), 3.0)  # early: held
    assert flight.gap_since == 3.0
    flight.packed(PackedChunk("t", 2, " c", int_array([9]), 3), 4.0)  # fills the gap
    merged = await flight.take()
    assert (merged.text, merged.output_ids, merged.completion_tokens, merged.cached_tokens
            ) == (" a b c d", [7, 8, 9, 10], 4, 2)
    assert (flight.gap_since, flight.last_output) == (None, 4.0)
    flight.packed(PackedChunk("t", 4, " e", int_array([11]), 5), 5.0)
    alone = flight.pop()
    assert alone is not None and flight.pop() is None
    assert (alone.text, alone.output_ids, alone.completion_tokens, alone.cached_tokens
            ) == (" e", [11], 5, 2)


def test_reassembly_keeps_the_cache_tiers_of_the_last_count_through_an_abort():
    assembler = ChunkAssembler(_request([1, 2, 3, 4, 5, 6, 7], rid="t"))
    counted = mpb.TextChunk(rid="t", seq=0, output_ids=[1], completion_tokens=1, cached_tokens=6,
                            cached_host_tokens=3, cached_storage_tokens=1)
    uncounted = mpb.TextChunk(rid="t", seq=1, output_ids=[2], completion_tokens=2)
    tiers = CachedTokens(device=2, host=3, storage=1)
    assert [c.cached_tokens_details for c in assembler.add(counted)] == [tiers]
    (second,) = assembler.add(uncounted)
    assert (second.cached_tokens, second.cached_tokens_details) == (6, tiers)
    assert assembler.abort("gone").cached_tokens_details == tiers


async def test_closing_the_iterator_early_sends_an_abort(mesh):
    engine = await mesh.add_engine("e", hold=True)
    gen = mesh.client.generate(_request([1, 2, 3], rid="held", max_new_tokens=8))
    first = await gen.__anext__()
    assert first.output_ids == [1]
    await gen.aclose()
    await engine.wait_for("aborts")
    assert engine.aborts == ["held"]
    assert mesh.client.in_flight == 0


async def test_cancelling_the_consumer_task_sends_an_abort(mesh):
    engine = await mesh.add_engine("e", hold=True)
    started = asyncio.Event()

    async def consume() -> None:
        async with aclosing(mesh.client.generate(_request([1], rid="task", max_new_tokens=8))) as g:
            async for _ in g:
                started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await engine.wait_for("aborts")
    assert engine.aborts == ["task"]


async def test_no_engine_is_503(mesh):
    with pytest.raises(GenerationError) as info:
        await _run(mesh.client, _request([1, 2]))
    assert info.value.status == 503


async def test_past_max_queued_requests_is_503_with_retry_after_then_room_again(mesh):
    """Requests without output yet count as queued; past the limit a new one is refused at
    once, without reaching an engine, and the limit frees up as the queued ones start."""
    engine = await mesh.add_engine("e", delay_s=0.5)  # each chunk half a second apart
    mesh.client.max_queued = 2
    waiting = [asyncio.create_task(_run(mesh.client, _request([1, 2], max_new_tokens=2)))
               for _ in range(2)]
    while mesh.client.queued < 2:
        await asyncio.sleep(0.01)
    with pytest.raises(GenerationError) as refused:
        await _run(mesh.client, _request([3], max_new_tokens=2))
    assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
    assert "2 requests are waiting for their first token (max_queued_requests 2)" in str(
        refused.value)
    assert len(engine.requests) == 2  # the refused one never reached the engine
    assert [len(chunks) for chunks in await asyncio.gather(*waiting)] == [2, 2]
    assert mesh.client.queued == 0
    assert [c.output_ids for c in await _run(mesh.client, _request([3], max_new_tokens=1))] == [[3]]


async def test_a_down_engine_is_routed_around_at_once(mesh):
    down = await mesh.add_engine("down")
    up = await mesh.add_engine("up")
    down.down = True
    while down.engine_id in mesh.client.engines:
        await asyncio.sleep(0.01)
    assert mesh.client.engines.ids == [up.engine_id]
    for i in range(4):
        await _run(mesh.client, _request([i, 7, 7], max_new_tokens=1))
    assert not down.requests and len(up.requests) == 4


async def test_a_request_its_engine_lost_before_any_output_is_retried_once(mesh):
    losing = await mesh.add_engine("losing", lose=True)
    # Only the losing engine: the retry finds no other and the abort stands.
    chunks = await _run(mesh.client, _request([1, 2], max_new_tokens=2))
    assert [c.finish.to_dict() for c in chunks] == [{"type": "abort", "matched": None,
                                           "message": f"engine {losing.engine_id} lost its worker"}]
    # With a healthy engine too: the lost request runs there, as if new.
    healthy = await mesh.add_engine("healthy")
    healthy.load = 5  # busier: the losing engine is picked first
    await asyncio.sleep(0.2)  # both heartbeats heard again
    chunks = await _run(mesh.client, _request([1, 2], max_new_tokens=2))
    assert _ids(chunks) == [1, 2]
    assert chunks[-1].finish.kind is FinishKind.LENGTH
    assert len(losing.requests) == 2 and len(healthy.requests) == 1


async def test_a_constraint_its_engine_cannot_compile_is_an_error_naming_it(mesh):
    """The front door checks a constraint's form only (it loads no grammar library): the
    engine's refusal, before any output, comes back as a 400 naming the field."""
    engine = await mesh.add_engine("e", refuse_grammars=True)
    with pytest.raises(GenerationError) as err:
        await _run(mesh.client, _request([1, 2], max_new_tokens=2, regex="(a"))
    assert (err.value.status, err.value.param) == (400, "regex")
    assert "the regex could not be compiled" in str(err.value)
    assert engine.aborts == [] and mesh.client.in_flight == 0
    assert _ids(await _run(mesh.client, _request([1, 2], max_new_tokens=2))) == [1, 2]


async def test_output_with_a_lasting_hole_ends_and_is_aborted(mesh, monkeypatch):
    monkeypatch.setattr(flights_module, "GAP_TIMEOUT_S", 0.3)
    engine = await mesh.add_engine("e", gap=True)
    chunks = await _run(mesh.client, _request([1, 2, 3], rid="holed", max_new_tokens=3))
    assert chunks[-1].finish.to_dict() == {
        "type": "abort", "matched": None,
        "message": "part of the output was lost on its way (a detokenizer went away)"}
    await engine.wait_for("aborts")
    assert engine.aborts == ["holed"]


async def test_a_request_without_output_for_stall_timeout_ends(mesh):
    engine = await mesh.add_engine("e", delay_s=5.0)
    mesh.client.stall_timeout_s = 0.3
    chunks = await _run(mesh.client, _request([1], rid="stalled", max_new_tokens=2))
    assert chunks[-1].finish.to_dict() == {"type": "abort", "matched": None,
                                 "message": "no output for 0.3 s"}
    await engine.wait_for("aborts")


async def test_a_rid_already_running_is_refused(mesh):
    await mesh.add_engine("e", hold=True)
    gen = mesh.client.generate(_request([1], rid="dup", max_new_tokens=4))
    await gen.__anext__()
    with pytest.raises(GenerationError) as info:
        await _run(mesh.client, _request([1], rid="dup"))
    assert info.value.status == 400
    await gen.aclose()


async def test_a_vanished_engine_ends_its_requests_with_an_abort(nc, tokenizer):
    m = Mesh(nc, tokenizer, engine_timeout_s=0.3)
    await m.client.start()
    try:
        engine = await m.add_engine("e", hold=True)
        assert m.client.context_length == 4096 and m.client.vocab_size == 49152
        gen = m.client.generate(_request([1, 2], max_new_tokens=4))
        await gen.__anext__()
        await engine.stop()
        last = await asyncio.wait_for(gen.__anext__(), 5)
        assert last.finish.kind is FinishKind.ABORT
        assert engine.engine_id in last.finish.message
        with pytest.raises(StopAsyncIteration):
            await gen.__anext__()
        assert len(m.client.engines) == 0 and m.client.context_length == 0
    finally:
        await m.close()


async def test_context_length_is_the_smallest_an_engine_reports(mesh):
    await mesh.add_engine("a", context_length=2048)
    await mesh.add_engine("b", context_length=1024)
    assert mesh.client.context_length == 1024


# ---- routing -----------------------------------------------------------------------------


async def test_shared_prefixes_stick_to_one_engine_and_unrelated_prompts_spread(mesh):
    # Slow heartbeats: the load this router counts is only what it sent itself.
    a = await mesh.add_engine("a", heartbeat_s=30)
    b = await mesh.add_engine("b", heartbeat_s=30)
    system = list(range(1000, 1064))
    last = []
    for i in range(4):
        chunks = await _run(mesh.client, _request(system + [i, i + 1], max_new_tokens=1))
        last.append(chunks[-1])
    assert sorted([len(a.requests), len(b.requests)]) == [0, 4]
    # The engine's own counts, passed through with their tiers.
    assert [c.cached_tokens for c in last] == [0, 64, 64, 64]
    hit = CachedTokens.split(64, host=host_part(64))
    assert [c.cached_tokens_details for c in last] == [CachedTokens()] + [hit] * 3
    unrelated = [_request(list(range(2000 + 100 * i, 2040 + 100 * i)), max_new_tokens=1)
                 for i in range(5)]
    await asyncio.gather(*(_run(mesh.client, r) for r in unrelated))
    assert len(a.requests) + len(b.requests) == 9
    loads = [mesh.client.router.load(a.engine_id), mesh.client.router.load(b.engine_id)]
    assert abs(loads[0] - loads[1]) <= 1


async def test_cache_events_steer_routing(mesh):
    a = await mesh.add_engine("a")
    b = await mesh.add_engine("b")
    prompt = list(range(300, 340))
    await b.announce_cached(prompt)
    await mesh.nc.flush()
    await asyncio.sleep(0.05)  # the event has no reply to wait on
    await _run(mesh.client, _request(prompt + [1], max_new_tokens=1))
    assert len(b.requests) == 1 and len(a.requests) == 0


async def test_flush_cache_and_engine_infos(mesh):
    a = await mesh.add_engine("a")
    b = await mesh.add_engine("b")
    assert await mesh.client.flush_cache()
    assert a.flushes == 1 and b.flushes == 1
    b.flush_ok = False
    assert not await mesh.client.flush_cache()
    infos = await mesh.client.engine_infos()
    assert sorted(i["engine_id"] for i in infos) == sorted([a.engine_id, b.engine_id])


# ---- the process -------------------------------------------------------------------------


def test_module_serves_and_stops_cleanly_on_sigterm(nats_url):
    env = {**os.environ, "NATS_URL": nats_url, "RADIXMESH_PORT": "0",
           "RADIXMESH_GRPC_PORT": "-1"}
    lines = []
    with service_process("radixmesh.services.tokenizer", "--replica-id", "proc", env=env) as proc:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "serving" in line:
                break
        assert re.search(r"HTTP on 127\.0\.0\.1:\d+, gRPC off", lines[-1]), lines
        assert any('"replica_id": "proc"' in line for line in lines)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


async def test_stop_lets_requests_finish_within_the_grace_period_then_aborts(nats_url, nc,
                                                                             tokenizer):
    config = TokenizerServiceConfig(nats_url=nats_url, port=0, grpc_port=-1,
                                    replica_id=os.urandom(6).hex(), shutdown_grace=0.5)
    server = TokenizerServer(config, tokenizer=tokenizer)
    await server.start()
    slow = await FakeEngine(nc, "slow", delay_s=0.01).start()
    held = await FakeEngine(nc, "held", hold=True).start()
    await server.client.wait_for_engines(2)
    url = f"http://127.0.0.1:{server.port}/generate"

    async def call(http, rid: str, prompt: list[int]) -> tuple[int, bytes]:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 10}, "rid": rid}
        async with http.post(url, json=body) as resp:
            return resp.status, await resp.read()

    try:
        async with aiohttp.ClientSession() as http:
            finishing = asyncio.create_task(call(http, "finishing", [1, 2]))
            await slow.wait_for("requests")
            stuck = asyncio.create_task(call(http, "stuck", [3, 4]))
            await held.wait_for("requests")
            await server.stop()
            status, body = await finishing
            assert status == 200
            assert json.loads(body)["meta_info"]["completion_tokens"] == 10
            assert held.aborts == ["stuck"]
            with pytest.raises(aiohttp.ClientError):
                await stuck
    finally:
        await slow.stop()
        await held.stop()


def test_server_info_hides_nats_credentials():
    config = TokenizerServiceConfig(nats_url="nats://user:secret@mesh:4222")
    assert public_args(config)["nats_url"] == "nats://mesh:4222"
