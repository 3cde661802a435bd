"""The detokenizer service on a NATS server of its own: chunks reach each request's owner,
a stop string aborts the engine, SIGTERM stops the process cleanly."""

from __future__ import annotations

import asyncio
import functools
import os
import queue
import re
import signal
import threading

import aiohttp
import nats
import pytest
from process_helpers import service_process

from radixmesh.core.detokenize import detok_context_size
from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.sampling_params import SamplingParams
from radixmesh.core.service_settings import DetokenizerConfig
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.engine.request import Req
from radixmesh.mesh import subjects
from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.proto import worker_pb2 as wpb
from radixmesh.proto.convert import packed_chunks
from radixmesh.services.detokenizer.server import (
    DetokenizerService,
    StepReplies,
    step_replies,
)
from radixmesh.services.scheduler.mesh_io import (
    MAX_UPDATE_GAP_S,
    UNSTREAMED_INTERVAL,
    StepMessage,
    UpdateBuilder,
)

OWNER_A = subjects.tokenizer_out("a")
OWNER_B = subjects.tokenizer_out("b")
ENGINE = "e1"
# A prefix hit split by tier, passed through untouched.
CACHED = {"cached_tokens": 6, "cached_host_tokens": 3, "cached_storage_tokens": 1}


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_path(None)


def update(
    rid: str, owner: str, seq: int, prompt: list[int], sent: list[int], new: list[int],
    **fields: object,
) -> mpb.TokenUpdate:
    """Update `seq` of request `rid` from ENGINE for `owner`: `new` ids after the `sent` ones,
    with the prompt and what was sent as context."""
    return mpb.TokenUpdate(
        rid=rid,
        reply_to=owner,
        seq=seq,
        offset=len(sent),
        context_ids=[*prompt, *sent],
        new_ids=new,
        engine_id=ENGINE,
        **fields,
    )


def two_requests() -> tuple[mpb.TokenStep, mpb.TextChunks, mpb.TextChunks, mpb.AbortRequest]:
    """A step with a plain update for owner A and a stop-string match for owner B."""
    tok = tokenizer()
    prompt = tok.encode("Hi")
    hello = tok.encode(" Hello 😀 world")
    plain = update(
        "r1", OWNER_A, 0, prompt, sent=[], new=hello,
        detok=mpb.DetokSpec(skip_special_tokens=True, prompt_tail=prompt),
        prompt_tokens=1,
        **CACHED,
        logprobs=mpb.Logprobs(
            output=[-0.5, -1.0, -1.5, -2.0],
            output_top=[
                wpb.TopLogprobs(items=[wpb.TokenLogprob(token_id=i, logprob=-0.1)]) for i in hello
            ],
        ),
    )
    one, end, two = tok.encode(" one END two")
    stopping = update(
        "r2", OWNER_B, 1, prompt, sent=[one], new=[end, two],
        detok=mpb.DetokSpec(stop=["END"], skip_special_tokens=True, prompt_tail=prompt),
        prompt_tokens=1,
    )
    step = mpb.TokenStep(updates=[plain, stopping])
    expected_a = mpb.TextChunks(
        chunks=[
            mpb.TextChunk(
                rid="r1",
                seq=0,
                text=" Hello 😀 world",
                output_ids=hello,
                prompt_tokens=1,
                **CACHED,
                completion_tokens=4,
                logprobs=plain.logprobs,
            )
        ]
    )
    finish = mpb.Finish(kind="stop", text="END")
    expected_b = mpb.TextChunks(
        chunks=[
            mpb.TextChunk(
                rid="r2",
                seq=1,
                text=" ",
                output_ids=[end],
                finish=finish,
                prompt_tokens=1,
                completion_tokens=2,
            )
        ]
    )
    return step, expected_a, expected_b, mpb.AbortRequest(rid="r2", finish=finish)


def test_stop_token_is_counted_but_not_shown() -> None:
    tok = tokenizer()
    prompt = tok.encode("Hi")
    stopped = update(
        "r", OWNER_A, 3, prompt, sent=tok.encode(" a b c"), new=[*tok.encode(" d"), 2],
        detok=mpb.DetokSpec(stop=["x"], skip_special_tokens=False),
        finish=mpb.Finish(kind="stop", token_id=2),
    )
    replies = step_replies(mpb.TokenStep(updates=[stopped]), tok.decode)
    (chunk,) = replies.chunks[OWNER_A].chunks
    assert (chunk.text, list(chunk.output_ids), chunk.completion_tokens) == (
        " d",
        list(stopped.new_ids),
        5,
    )
    assert chunk.finish == stopped.finish
    assert replies.aborts == [] and replies.stop_matches == 0


def test_updates_after_a_stop_string_repeat_the_stop() -> None:
    tok = tokenizer()
    prompt = tok.encode("Hi")
    out = tok.encode(" one END two three")
    spec = mpb.DetokSpec(stop=["END"], skip_special_tokens=True)
    late = update("r", OWNER_A, 2, prompt, sent=out[:3], new=out[3:], detok=spec)
    last = update(
        "r", OWNER_A, 3, prompt, sent=out, new=[], detok=spec,
        finish=mpb.Finish(kind="stop", text="END"),
    )
    replies = step_replies(mpb.TokenStep(updates=[late, last]), tok.decode)
    stop = mpb.Finish(kind="stop", text="END")
    assert list(replies.chunks[OWNER_A].chunks) == [
        mpb.TextChunk(rid="r", seq=2, finish=stop, completion_tokens=2),
        mpb.TextChunk(rid="r", seq=3, finish=stop, completion_tokens=2),
    ]
    # Only the update the engine may still be running for asks it again to stop.
    assert replies.aborts == [
        (subjects.engine_abort(ENGINE), mpb.AbortRequest(rid="r", finish=stop))
    ]
    assert replies.stop_matches == 0


def test_the_cache_tiers_of_a_request_reach_its_updates_and_chunks() -> None:
    tok = tokenizer()
    prompt = tok.encode("one two three four five six")
    req = Req(rid="r", input_ids=prompt, params=SamplingParams(max_new_tokens=2), seed=0)
    builder = UpdateBuilder(ENGINE)
    builder.register(req, mpb.EngineRequest(reply_to=OWNER_A, detok_context=1))
    req.cached_tokens, req.cached_host_tokens = 5, 2
    req.output_ids.append(100)
    first = builder.build(req)
    req.output_ids.append(200)
    req.finish = FinishReason(FinishKind.LENGTH, 2)
    updates = [first, builder.build(req)]
    # Every update, not only the first, carries the whole split; no storage tier yet.
    for update in updates:
        assert (update.cached_tokens, update.cached_host_tokens) == (5, 2)
        assert update.cached_storage_tokens == 0
    chunks = step_replies(mpb.TokenStep(updates=updates), tok.decode).chunks[OWNER_A].chunks
    assert [(c.cached_tokens, c.cached_host_tokens, c.cached_storage_tokens) for c in chunks] == [
        (5, 2, 0),
        (5, 2, 0),
    ]


def unpacked(message: mpb.TextChunks) -> list[mpb.TextChunk]:
    """A TextChunks' chunks, its packed ones as TextChunks."""
    return [*message.chunks, *(
        mpb.TextChunk(rid=c.rid, seq=c.seq, text=c.text, output_ids=c.ids,
                      completion_tokens=c.completion_tokens)
        for c in packed_chunks(message.packed))]


def _registered(builder: UpdateBuilder, tok: Tokenizer, stops: dict[str, list[str]]
                ) -> list[Req]:
    reqs = []
    for rid, stop in stops.items():
        req = Req(rid=rid, input_ids=tok.encode("Say it."),
                  params=SamplingParams(max_new_tokens=128, stop=stop), seed=0)
        builder.register(req, mpb.EngineRequest(
            reply_to=OWNER_A, detok=mpb.DetokSpec(stop=stop, skip_special_tokens=True,
                                                  prompt_tail=req.input_ids[-4:]),
            detok_context=detok_context_size(stop)))
        reqs.append(req)
    return reqs


@pytest.mark.parametrize("pieces", [False, True], ids=["decodes", "pieces"])
def test_packed_updates_read_as_the_same_updates_in_full(pieces: bool) -> None:
    """A step's updates of new ids alone travel packed; each request's chunks, and the stop
    string that ends one (aborting its engine), are what the same updates give in full
    (decoded, and with `pieces` from the ids' own texts where they can be)."""
    tok = tokenizer()
    answer = tok.encode(" Sure: caf\u00e9 au lait \U0001f600, and more text." * 4 + " THE END")
    stops = {"plain": [], "stopped": ["THE END"]}
    full_builder, packed_builder = UpdateBuilder(ENGINE), UpdateBuilder(ENGINE)
    full_reqs = _registered(full_builder, tok, stops)
    packed_reqs = _registered(packed_builder, tok, stops)
    full, packed = [], []
    for token in answer:
        for req in [*full_reqs, *packed_reqs]:
            req.output_ids.append(token)
        full.append(mpb.TokenStep(updates=[full_builder.build(r) for r in full_reqs]))
        step = StepMessage(ENGINE)
        for req in packed_reqs:
            packed_builder.add(step, req)
        packed.append(step.to_proto())
    assert sum(len(s.packed.rids) for s in packed) > len(answer)  # most of them
    got = [step_replies(s, tok.decode, tok.pieces if pieces else None) for s in packed]
    want = [step_replies(s, tok.decode) for s in full]
    fields = ("rid", "seq", "text", "output_ids", "completion_tokens", "finish")

    def chunks(replies: list[StepReplies]) -> list[list[object]]:
        # Within a step the packed updates come after the others: in order per request.
        return sorted(([getattr(c, f) for f in fields]
                       for r in replies for c in unpacked(r.chunks[OWNER_A])),
                      key=lambda c: c[:2])

    assert any(r.chunks[OWNER_A].packed.rids for r in got)
    assert chunks(got) == chunks(want)
    assert "".join(c.text for r in got for c in unpacked(r.chunks[OWNER_A])
                   if c.rid == "plain") == tok.decode(answer)
    assert [(subject, abort.rid) for r in got for subject, abort in r.aborts] == [
        (subjects.engine_abort(ENGINE), "stopped")]


def test_updates_come_as_often_as_the_caller_reads_the_output() -> None:
    """After its first token at once: a streamed request's updates every stream_interval
    tokens, an unstreamed one's every UNSTREAMED_INTERVAL, every token where stop strings
    are looked for; each finish at once. Each request's chunks still add up to its text."""
    tok = tokenizer()
    answer = tok.encode(" The caf\u00e9 is open \U0001f600 until late tonight." * 20)[:150]
    assert len(answer) == 150
    builder = UpdateBuilder(ENGINE, stream_interval=4, clock=lambda: 0.0)
    kinds = {"streamed": (True, []), "unstreamed": (False, []), "stops": (False, ["zzz"])}
    reqs = []
    for rid, (stream, stop) in kinds.items():
        req = Req(rid=rid, input_ids=tok.encode("Say it."),
                  params=SamplingParams(max_new_tokens=len(answer), stop=stop), seed=0)
        builder.register(req, mpb.EngineRequest(
            reply_to=OWNER_A, stream=stream, detok=mpb.DetokSpec(stop=stop),
            detok_context=detok_context_size(stop)))
        reqs.append(req)
    sizes: dict[str, list[int]] = {rid: [] for rid in kinds}
    texts: dict[str, str] = dict.fromkeys(kinds, "")
    for n, token in enumerate(answer, 1):
        step = StepMessage(ENGINE)
        for req in reqs:
            req.output_ids.append(token)
            if n == len(answer):
                req.finish = FinishReason(FinishKind.LENGTH, n)
            if builder.due(req, MAX_UPDATE_GAP_S / 2):
                sent = builder.add(step, req)
                assert sent is not None
                sizes[req.rid].append(sent.new_tokens)
        for chunk in unpacked(step_replies(step.to_proto(), tok.decode).chunks[OWNER_A]):
            texts[chunk.rid] += chunk.text
    assert sizes["streamed"] == [1, *[4] * 37, 1]
    assert sizes["unstreamed"] == [1, UNSTREAMED_INTERVAL, UNSTREAMED_INTERVAL, 21]
    assert sizes["stops"] == [1] * 150
    assert set(texts.values()) == {tok.decode(answer)}


def test_new_tokens_wait_at_most_max_update_gap_s_for_their_interval() -> None:
    """A slow model's unstreamed answer still shows progress: tokens that have waited
    MAX_UPDATE_GAP_S since the last update go out, however few."""
    builder = UpdateBuilder(ENGINE, clock=lambda: 100.0)
    req = Req(rid="slow", input_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=500),
              seed=0)
    builder.register(req, mpb.EngineRequest(reply_to=OWNER_A, stream=False))
    req.output_ids.append(7)
    assert builder.due(req, 100.0)  # the first token goes at once
    builder.add(StepMessage(ENGINE), req)
    req.output_ids.append(8)
    assert not builder.due(req, 100.0 + MAX_UPDATE_GAP_S / 2)
    assert builder.due(req, 100.0 + MAX_UPDATE_GAP_S)


def test_a_bad_update_aborts_only_its_request() -> None:
    tok = tokenizer()
    bad = mpb.TokenUpdate(rid="bad", reply_to=OWNER_A, seq=0, new_ids=[-1], engine_id=ENGINE,
                          **CACHED)
    good = mpb.TokenUpdate(rid="ok", reply_to=OWNER_A, seq=0, new_ids=tok.encode("fine"))
    nowhere = mpb.TokenUpdate(rid="lost", seq=0, new_ids=tok.encode("x"))
    replies = step_replies(mpb.TokenStep(updates=[bad, good, nowhere]), tok.decode)
    failed, fine = replies.chunks[OWNER_A].chunks
    assert failed.finish.kind == "abort" and failed.finish.message.startswith("detokenizer")
    assert {name: getattr(failed, name) for name in CACHED} == CACHED
    assert fine.text == "fine" and not fine.HasField("finish")
    assert list(replies.chunks) == [OWNER_A]
    assert [subject for subject, _ in replies.aborts] == [subjects.engine_abort(ENGINE)]
    assert replies.errors == 1


async def _exchange(url: str) -> None:
    config = DetokenizerConfig(nats_url=url, replica_id="test")
    service = DetokenizerService(config, tokenizer())
    await service.start()
    client = await nats.connect(url)
    try:
        inbox_a = await client.subscribe(OWNER_A)
        inbox_b = await client.subscribe(OWNER_B)
        aborts = await client.subscribe(subjects.engine_abort(ENGINE))
        await client.flush()
        step, expected_a, expected_b, expected_abort = two_requests()
        await client.publish(subjects.DETOK, step.SerializeToString())
        got_a = mpb.TextChunks.FromString((await inbox_a.next_msg(timeout=10)).data)
        got_b = mpb.TextChunks.FromString((await inbox_b.next_msg(timeout=10)).data)
        got_abort = mpb.AbortRequest.FromString((await aborts.next_msg(timeout=10)).data)
        assert got_a == expected_a
        assert got_b == expected_b
        assert got_abort == expected_abort
        base = f"http://{config.host}:{service.metrics_port}"
        async with aiohttp.ClientSession() as http:
            async with http.get(base + "/health") as response:
                assert response.status == 200
                assert (await response.json())["status"] == "ok"
            async with http.get(base + "/metrics") as response:
                body = await response.text()
        for name in ("updates_total", "chunks_total", "stop_string_matches_total"):
            assert f"radixmesh:detokenizer_{name} " in body
        assert "radixmesh:detokenizer_handle_seconds_count" in body
    finally:
        await client.close()
        await service.stop()


def test_step_reaches_each_owner_and_a_stop_aborts_the_engine(nats_url: str) -> None:
    asyncio.run(_exchange(nats_url))


def _lines(stream: object, into: queue.Queue[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        into.put(line)


def test_sigterm_stops_the_process_cleanly(nats_url: str) -> None:
    with service_process("radixmesh.services.detokenizer", "--nats-url", nats_url) as proc:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_lines, args=(proc.stderr, lines), daemon=True).start()
        seen = []
        while not any(" ready: " in line for line in seen):
            seen.append(lines.get(timeout=60))
        assert "starting with config" in seen[0]
        assert re.search(r"/metrics on 127\.0\.0\.1:\d+", seen[-1])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_nats_credentials_in_the_url_are_used_and_never_shown() -> None:
    from radixmesh.mesh.nats_server import EmbeddedNats

    with EmbeddedNats(user="rm", password="pw-7c1e9") as server:
        for url, ok in [(server.url, True), (server.url.replace("pw-7c1e9", "wrong"), False)]:
            env = {**os.environ, "RADIXMESH_NATS_URL": url}
            with service_process("radixmesh.services.detokenizer", env=env) as proc:
                lines: queue.Queue[str] = queue.Queue()
                threading.Thread(target=_lines, args=(proc.stderr, lines), daemon=True).start()
                if ok:
                    seen = [lines.get(timeout=60)]
                    while " ready: " not in seen[-1]:
                        seen.append(lines.get(timeout=60))
                    assert "nats://127.0.0.1:" in seen[0]  # the URL, less its credentials
                    assert not any("pw-7c1e9" in line for line in seen)
                    proc.send_signal(signal.SIGTERM)
                    assert proc.wait(timeout=30) == 0
                else:  # refused: it says why, and keeps trying (as for a server not up yet)
                    seen = [lines.get(timeout=60)]
                    while "uthorization" not in seen[-1]:
                        seen.append(lines.get(timeout=60))
                    assert not any(" ready: " in line for line in seen)
