"""The detokenizer service: TokenSteps in from the schedulers (one queue group, so any
replica may get any update), TextChunks out to the tokenizer replicas that own the
requests, and an AbortRequest to the engine when a stop string ends a request."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import nats
from google.protobuf.message import DecodeError
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from radixmesh.core.detokenize import (
    DecodeFn,
    Pieces,
    TextRules,
    Update,
    WindowText,
    joined_pieces,
    window_text,
)
from radixmesh.core.model_files import resolve_model_path
from radixmesh.core.service_settings import DetokenizerConfig
from radixmesh.core.step import int_array
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.mesh import subjects
from radixmesh.mesh.service import StatusServer, connect_bus
from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.proto.convert import PackedChunk, packed_updates
from radixmesh.services.detokenizer import metrics
from radixmesh.services.detokenizer.step_trace import StepTrace

log = logging.getLogger("radixmesh.detokenizer")


class StepReplies(NamedTuple):
    """What one TokenStep turns into."""

    chunks: dict[str, mpb.TextChunks]  # by reply_to subject
    aborts: list[tuple[str, mpb.AbortRequest]]  # (engine abort subject, message)
    stop_matches: int  # stop strings completed by the step's tokens
    errors: int


class _Outbox:
    """One owner's TextChunks as they are built: full chunks, and plain ones packed."""

    def __init__(self) -> None:
        self.chunks: list[mpb.TextChunk] = []
        self.rids: list[str] = []
        self.texts: list[str] = []
        self.seqs, self.id_lens = int_array(), int_array()
        self.ids, self.completions = int_array(), int_array()

    def plain(self, chunk: PackedChunk) -> None:
        self.rids.append(chunk.rid)
        self.seqs.append(chunk.seq)
        self.texts.append(chunk.text)
        self.id_lens.append(len(chunk.ids))
        self.ids.extend(chunk.ids)
        self.completions.append(chunk.completion_tokens)

    def to_proto(self) -> mpb.TextChunks:
        out = mpb.TextChunks(chunks=self.chunks)
        if self.rids:
            p = out.packed
            p.rids.extend(self.rids)
            p.texts.extend(self.texts)
            p.seqs, p.id_lens = self.seqs.tobytes(), self.id_lens.tobytes()
            p.ids, p.completion_tokens = self.ids.tobytes(), self.completions.tobytes()
        return out


class UpdateReply(NamedTuple):
    """What one TokenUpdate turns into."""

    chunk: mpb.TextChunk
    stop_matched: bool  # a stop string completed within the update's new ids
    stops_engine: bool  # the chunk ends a request the engine still runs
    failed: bool = False  # the update could not be detokenized: the chunk ends the request


def text_chunk(update: mpb.TokenUpdate, decode: DecodeFn, pieces: Pieces = None
               ) -> UpdateReply:
    """The chunk of one update, with the stop strings of its request applied (`pieces`:
    see window_text)."""
    spec = update.detok
    finish = update.finish if update.HasField("finish") else None
    trim_stop_token = (
        finish is not None
        and finish.kind == "stop"
        and finish.WhichOneof("matched") == "token_id"
        and not spec.no_stop_trim
    )
    window = window_text(decode, _rules(spec), Update(
        update.context_ids, update.new_ids, update.offset, finish is not None, trim_stop_token,
        spec.prompt_tail,
    ), pieces)
    reply = _reply(update.rid, update.seq, update.offset, update.new_ids, window, finish)
    chunk = reply.chunk
    chunk.prompt_tokens = update.prompt_tokens
    chunk.cached_tokens = update.cached_tokens
    chunk.cached_host_tokens = update.cached_host_tokens
    chunk.cached_storage_tokens = update.cached_storage_tokens
    chunk.spec_verify_ct = update.spec_verify_ct
    chunk.spec_accepted_tokens = update.spec_accepted_tokens
    if update.HasField("logprobs"):
        chunk.logprobs.CopyFrom(_kept_logprobs(update.logprobs, len(chunk.output_ids)))
    if update.HasField("transfer"):  # which engines served it matters only when two did
        chunk.engine_id = update.engine_id
        chunk.transfer.CopyFrom(update.transfer)
    return reply._replace(stops_engine=reply.stops_engine and finish is None)


def _rules(spec: mpb.DetokSpec) -> TextRules:
    return TextRules(
        tuple(spec.stop), spec.no_stop_trim, spec.skip_special_tokens, spec.min_new_tokens,
        spec.spaces_between_special_tokens,
    )


def _reply(rid: str, seq: int, offset: int, new_ids: Sequence[int], window: WindowText,
           finish: mpb.Finish | None) -> UpdateReply:
    """The chunk of an update whose new ids' text is `window`: a stop string the text
    completes ends it (the finish it stops the engine with, unless it came with one)."""
    total = offset + len(new_ids)
    kept, completion = len(new_ids), total
    # A stop string completed by the last token of a finished request trims the text but
    # keeps the finish the engine reported, as the in-process engine does.
    stopped = window.stop_at is not None and (finish is None or window.stop_at < total)
    if window.stop_at is not None:
        completion = window.stop_at
    if stopped:
        kept = max(completion - offset, 0)
        finish = mpb.Finish(kind="stop", text=window.matched)
    chunk = mpb.TextChunk(rid=rid, seq=seq, text=window.text, output_ids=new_ids[:kept],
                          finish=finish, completion_tokens=completion)
    matched_here = window.stop_at is not None and window.stop_at > offset
    return UpdateReply(chunk, matched_here, stopped)


def packed_replies(step: mpb.TokenStep, decode: DecodeFn, pieces: Pieces = None
                   ) -> Iterator[tuple[str, UpdateReply | PackedChunk]]:
    """The packed updates' chunks (see PackedUpdates), each with its reply_to subject: a
    packed chunk where it ends nothing."""
    p = step.packed
    rules = [_rules(spec) for spec in p.detok]
    quick = [pieces if r.plain else None for r in rules]  # whose texts the pieces may give
    for u in packed_updates(p):
        # A packed update's context holds at least the id before its new ids.
        if (known := quick[u.route]) is not None and (
                text := joined_pieces(known, u.new, after=u.context[-1])) is not None:
            yield p.reply_to[u.route], PackedChunk(u.rid, u.seq, text, u.new,
                                                   u.offset + len(u.new))
            continue
        try:
            window = window_text(decode, rules[u.route],
                                 Update(u.context, u.new, u.offset, False), pieces)
            reply: UpdateReply | PackedChunk = (
                PackedChunk(u.rid, u.seq, window.text, u.new, u.offset + len(u.new))
                if window.stop_at is None
                else _reply(u.rid, u.seq, u.offset, u.new, window, None))
        except Exception as exc:
            log.exception("cannot detokenize update %d of %s", u.seq, u.rid)
            reply = _failed(mpb.TokenUpdate(rid=u.rid, seq=u.seq, offset=u.offset), exc)
        yield p.reply_to[u.route], reply


def _kept_logprobs(logprobs: mpb.Logprobs, kept: int) -> mpb.Logprobs:
    """The logprobs of an update whose output ends after its first `kept` new ids."""
    out = mpb.Logprobs()
    out.CopyFrom(logprobs)
    del out.output[kept:]
    del out.output_top[kept:]
    return out


def _failed(update: mpb.TokenUpdate, error: Exception) -> UpdateReply:
    chunk = mpb.TextChunk(
        rid=update.rid,
        seq=update.seq,
        finish=mpb.Finish(kind="abort", message=f"detokenizer error: {error}"),
        prompt_tokens=update.prompt_tokens,
        cached_tokens=update.cached_tokens,
        cached_host_tokens=update.cached_host_tokens,
        cached_storage_tokens=update.cached_storage_tokens,
        completion_tokens=update.offset,
    )
    return UpdateReply(chunk, False, not update.HasField("finish"), failed=True)


def step_replies(step: mpb.TokenStep, decode: DecodeFn, pieces: Pieces = None
                 ) -> StepReplies:
    """Detokenize every update of a step: one TextChunks per owner, aborts for the engines
    (`pieces`: see window_text)."""
    boxes: dict[str, _Outbox] = {}
    aborts: list[tuple[str, mpb.AbortRequest]] = []
    stop_matches = errors = 0
    for reply_to, engine_id, reply in _replies(step, decode, pieces):
        if isinstance(reply, PackedChunk):
            _outbox(boxes, reply_to).plain(reply)
            continue
        errors += reply.failed
        stop_matches += reply.stop_matched
        chunk = reply.chunk
        if reply_to:
            _outbox(boxes, reply_to).chunks.append(chunk)
        else:
            log.warning("update %d of %s names no reply subject", chunk.seq, chunk.rid)
        if reply.stops_engine and engine_id:
            abort = mpb.AbortRequest(rid=chunk.rid, finish=chunk.finish)
            aborts.append((subjects.engine_abort(engine_id), abort))
    chunks = {subject: box.to_proto() for subject, box in boxes.items()}
    return StepReplies(chunks, aborts, stop_matches, errors)


def _outbox(boxes: dict[str, _Outbox], owner: str) -> _Outbox:
    box = boxes.get(owner)
    if box is None:
        box = boxes[owner] = _Outbox()
    return box


def _replies(step: mpb.TokenStep, decode: DecodeFn, pieces: Pieces
             ) -> Iterator[tuple[str, str, UpdateReply | PackedChunk]]:
    """Every update's chunk, with its reply_to subject and its engine."""
    for update in step.updates:
        try:
            reply = text_chunk(update, decode, pieces)
        except Exception as exc:
            # One bad update must not hold back the other requests of the step.
            log.exception("cannot detokenize update %d of %s", update.seq, update.rid)
            reply = _failed(update, exc)
        yield update.reply_to, update.engine_id, reply
    if step.HasField("packed"):
        for reply_to, reply in packed_replies(step, decode, pieces):
            yield reply_to, step.engine_id, reply



class DetokenizerService:
    """One stateless replica in the detokenizer queue group."""

    def __init__(self, config: DetokenizerConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._nc: nats.NATS | None = None
        self._status = StatusServer(config.host, config.metrics_port, self._health)

    @property
    def metrics_port(self) -> int:
        """The bound /health and /metrics port (after start)."""
        return self._status.port

    async def start(self) -> None:
        """Load the tokenizer, then take TokenSteps from NATS."""
        await self._status.start()
        if self.tokenizer is None:
            path = await asyncio.to_thread(
                resolve_model_path, self.config.model_path, self.config.revision
            )
            self.tokenizer = await asyncio.to_thread(Tokenizer.from_path, str(path))
        tokenizer = self.tokenizer
        await asyncio.to_thread(lambda: tokenizer.pieces)  # built before the first step
        self._nc = await connect_bus(self.config.nats_url,
                                     f"detokenizer-{self.config.replica_id}")
        await self._nc.subscribe(subjects.DETOK, queue=subjects.DETOK_QUEUE, cb=self._on_step)
        await self._nc.flush()
        log.info(
            "detokenizer %s ready: tokenizer %s, /metrics on %s:%d",
            self.config.replica_id,
            self.tokenizer.source,
            self.config.host,
            self._status.port,
        )

    async def stop(self) -> None:
        """Finish the steps already received, then disconnect."""
        if self._nc is not None and not self._nc.is_closed:
            await self._nc.drain()
        await self._status.stop()

    def _health(self) -> tuple[bool, dict[str, Any]]:
        connected = self._nc is not None and self._nc.is_connected
        ok = connected and self.tokenizer is not None
        return ok, {"replica_id": self.config.replica_id, "nats_connected": connected}

    async def _on_step(self, msg: Msg) -> None:
        tokenizer = self.tokenizer
        assert tokenizer is not None
        trace = StepTrace()
        with metrics.HANDLE_SECONDS.time():
            try:
                step = mpb.TokenStep.FromString(msg.data)
            except DecodeError as exc:
                log.warning("dropping a TokenStep that does not parse: %s", exc)
                return
            replies = step_replies(step, tokenizer.decode, tokenizer.pieces)
            trace.decoded(step, replies)
            metrics.observe_step(step)
            metrics.STOP_MATCHES.inc(replies.stop_matches)
            metrics.ERRORS.inc(replies.errors)
            for reply_to, chunks in replies.chunks.items():
                await self._publish(reply_to, chunks.SerializeToString())
                metrics.CHUNKS.inc(len(chunks.chunks) + len(chunks.packed.rids))
            for subject, abort in replies.aborts:
                await self._publish(subject, abort.SerializeToString(), trace.headers(abort.rid))
            trace.end()

    async def _publish(
        self, subject: str, payload: bytes, headers: dict[str, str] | None = None
    ) -> None:
        assert self._nc is not None
        try:
            await self._nc.publish(subject, payload, headers=headers)
        except NatsError as exc:
            log.warning("could not publish to %r: %s", subject, exc)
