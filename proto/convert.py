"""The shared core types as protobuf and back: the one place each conversion is written.

Transport modules call these once per message; the scheduler and the model runner never
see protobuf."""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import NamedTuple

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.hicache import HostPoolSpec, KVGeometry
from radixmesh.core.sampling_params import GRAMMAR_KINDS, LogprobRequest, SamplingParams
from radixmesh.core.step import (
    EntryResult,
    KVCopy,
    KVExpect,
    KVSend,
    NewRequest,
    SendOutcome,
    StateSave,
    StepBatch,
    StepEntry,
    StepResult,
    TopLogprobs,
    int_array,
)
from radixmesh.proto import cache_pb2 as cpb
from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.proto import worker_pb2 as wpb

# The sampling parameters the engine needs, named alike on both sides; stop strings stay
# with the detokenizer.
_SAMPLING_FIELDS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "ignore_eos",
)


_KINDS = frozenset(kind.value for kind in FinishKind)


def finish_to_proto(reason: FinishReason) -> mpb.Finish:
    """FinishReason as the Finish message (a length limit travels as token_id)."""
    out = mpb.Finish(kind=reason.kind.value, message=reason.message or "", status=reason.status)
    if isinstance(reason.matched, str):
        out.text = reason.matched
    elif isinstance(reason.matched, int):
        out.token_id = reason.matched
    return out


def finish_from_proto(finish: mpb.Finish) -> FinishReason:
    """The FinishReason a Finish message carries."""
    which = finish.WhichOneof("matched")
    matched = getattr(finish, which) if which else None
    if finish.kind not in _KINDS:
        return FinishReason(FinishKind.ABORT, message=f"unknown finish {finish.kind!r}")
    return FinishReason(FinishKind(finish.kind), matched, finish.message or None, finish.status)


def sampling_to_proto(p: SamplingParams, seed: int) -> wpb.SamplingParams:
    """What the engine needs of a request's sampling parameters, with its seed."""
    fields = {name: getattr(p, name) for name in _SAMPLING_FIELDS}
    grammar = {name: getattr(p, name) or "" for name in GRAMMAR_KINDS}
    return wpb.SamplingParams(seed=seed, stop_token_ids=p.stop_token_ids,
                              logit_bias=p.logit_bias, **fields, **grammar)


def sampling_from_proto(p: wpb.SamplingParams) -> SamplingParams:
    """The other side of sampling_to_proto; the seed is `p.seed`. The front door checked
    them: they are not checked again."""
    fields = {name: getattr(p, name) for name in _SAMPLING_FIELDS}
    grammar = {name: getattr(p, name) or None for name in GRAMMAR_KINDS}
    return SamplingParams.checked(
        stop_token_ids=list(p.stop_token_ids), seed=p.seed, logit_bias=dict(p.logit_bias),
        **fields, **grammar,
    )


def _top_to_proto(top: TopLogprobs) -> wpb.TopLogprobs:
    return wpb.TopLogprobs(items=[wpb.TokenLogprob(token_id=t, logprob=lp) for t, lp in top])


def _top_from_proto(top: wpb.TopLogprobs) -> TopLogprobs:
    return [(t.token_id, t.logprob) for t in top.items]


def host_pool_to_proto(spec: HostPoolSpec) -> wpb.HostPool:
    """A host pool's place and layout as the worker maps it."""
    g = spec.geometry
    return wpb.HostPool(
        name=spec.name, path=spec.path, num_slots=spec.num_slots, layout=spec.layout,
        num_layers=g.num_layers, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
        dtype=g.dtype, page_size=g.page_size,
    )


def host_pool_from_proto(msg: wpb.HostPool) -> HostPoolSpec:
    """The other side of host_pool_to_proto."""
    geometry = KVGeometry(msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.dtype, msg.page_size)
    return HostPoolSpec(msg.name, msg.path, msg.num_slots, msg.layout, geometry)


def geometry_to_proto(g: KVGeometry) -> cpb.KVGeometry:
    """A KV geometry as cachectl's messages carry it."""
    return cpb.KVGeometry(num_layers=g.num_layers, num_kv_heads=g.num_kv_heads,
                          head_dim=g.head_dim, dtype=g.dtype, page_size=g.page_size)


def geometry_from_proto(msg: cpb.KVGeometry) -> KVGeometry:
    """The other side of geometry_to_proto."""
    return KVGeometry(msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.dtype, msg.page_size)


def segment_to_proto(spec: HostPoolSpec) -> cpb.HostPool:
    """A host segment as cachectl answers Open, with the storage tier behind it."""
    return cpb.HostPool(name=spec.name, path=spec.path, num_slots=spec.num_slots,
                        layout=spec.layout, geometry=geometry_to_proto(spec.geometry),
                        storage=spec.storage)


def segment_from_proto(msg: cpb.HostPool) -> HostPoolSpec:
    """The other side of segment_to_proto."""
    return HostPoolSpec(msg.name, msg.path, msg.num_slots, msg.layout,
                        geometry_from_proto(msg.geometry), msg.storage)


def batch_to_proto(batch: StepBatch) -> wpb.StepBatch:
    """A step as the scheduler sends it to every worker rank."""
    return wpb.StepBatch(
        step=batch.step,
        new_requests=[
            wpb.NewRequest(
                rid=n.rid,
                row=n.row,
                prefix_ids=n.prefix_ids,
                prefix_slots=n.prefix_slots,
                prompt_len=n.prompt_len,
                sampling=sampling_to_proto(n.params, n.seed),
                return_logprob=n.logprobs.return_logprob,
                top_logprobs_num=n.logprobs.top_logprobs_num,
                logprob_start_len=n.logprobs.logprob_start_len,
                lora=n.lora,
                pooling=n.pooling,
                score_ids=n.score_ids,
                snapshot=None if n.snapshot < 0 else n.snapshot,
            )
            for n in batch.new_requests
        ],
        entries=[
            wpb.StepEntry(
                rid=e.rid, input_ids=e.input_ids, slots=e.slots, sample=e.sample,
                draft=e.draft, draft_parents=e.draft_parents,
            )
            for e in batch.entries
        ],
        release=batch.release,
        copies=[
            wpb.KVCopy(
                copy_id=c.copy_id, to_host=c.to_host, device_slots=c.device_slots,
                host_slots=c.host_slots,
            )
            for c in batch.copies
        ],
        host_pool=None if batch.host_pool is None else host_pool_to_proto(batch.host_pool),
        grammars=[wpb.Constraint(kind=k, text=t) for k, t in batch.grammars],
        sends=[
            wpb.KVSend(rid=k.rid, slots=k.slots, dest_slots=k.dest_slots,
                       dest_workers=k.dest_workers, key=k.key, backend=k.backend,
                       dest_rid=k.dest_rid)
            for k in batch.sends
        ],
        expects=[wpb.KVExpect(rid=x.rid, slots=x.slots, key=x.key) for x in batch.expects],
        decode_rows=batch.decode_rows.tobytes(),
        decode_slots=batch.decode_slots.tobytes(),
        saves=[wpb.StateSave(row=s.row, after=s.after, slot=s.slot) for s in batch.saves],
    )


def batch_from_proto(msg: wpb.StepBatch) -> StepBatch:
    """The worker's side of batch_to_proto."""
    return StepBatch(
        msg.step,
        [
            NewRequest(
                n.rid,
                n.row,
                list(n.prefix_ids),
                list(n.prefix_slots),
                n.prompt_len,
                sampling_from_proto(n.sampling),
                n.sampling.seed,
                LogprobRequest(n.return_logprob, n.top_logprobs_num, n.logprob_start_len),
                n.lora,
                n.pooling,
                list(n.score_ids),
                n.snapshot if n.HasField("snapshot") else -1,
            )
            for n in msg.new_requests
        ],
        [
            StepEntry(
                e.rid, list(e.input_ids), list(e.slots), e.sample, list(e.draft),
                list(e.draft_parents),
            )
            for e in msg.entries
        ],
        list(msg.release),
        [
            KVCopy(c.copy_id, c.to_host, list(c.device_slots), list(c.host_slots))
            for c in msg.copies
        ],
        host_pool_from_proto(msg.host_pool) if msg.HasField("host_pool") else None,
        [(g.kind, g.text) for g in msg.grammars],
        [
            KVSend(k.rid, list(k.slots), list(k.dest_slots), list(k.dest_workers), k.key,
                   k.backend, k.dest_rid)
            for k in msg.sends
        ],
        [KVExpect(x.rid, list(x.slots), x.key) for x in msg.expects],
        ints(msg.decode_rows),
        ints(msg.decode_slots),
        [StateSave(s.row, s.after, s.slot) for s in msg.saves],
    )


def result_to_proto(result: StepResult) -> wpb.StepResult:
    """A step's result as a worker rank answers it."""
    return wpb.StepResult(
        step=result.step,
        results=[
            wpb.EntryResult(
                rid=r.rid,
                token_id=r.token_id,
                logprob=r.logprob,
                top_logprobs=_top_to_proto(r.top_logprobs),
                input_logprobs_start=r.input_logprobs_start,
                input_logprobs=r.input_logprobs,
                input_top_logprobs=[_top_to_proto(t) for t in r.input_top_logprobs],
                forced_ids=r.forced_ids,
                accepted_ids=r.accepted_ids,
                accepted_logprobs=r.accepted_logprobs,
                accepted_top_logprobs=[_top_to_proto(t) for t in r.accepted_top_logprobs],
                embedding=r.embedding,
            )
            for r in result.results
        ],
        forward_ms=result.forward_ms,
        copies_done=result.copies_done,
        grammars_ready=[wpb.Constraint(kind=k, text=t) for k, t in result.grammars_ready],
        grammars_failed=[
            wpb.GrammarFailure(constraint=wpb.Constraint(kind=k, text=t), error=error)
            for (k, t), error in result.grammars_failed
        ],
        sends_done=[
            wpb.SendOutcome(rid=o.rid, error=o.error, bytes=o.bytes, ms=o.ms)
            for o in result.sends_done
        ],
        decode_tokens=result.decode_tokens.tobytes(),
    )


def result_from_proto(msg: wpb.StepResult) -> StepResult:
    """The scheduler's side of result_to_proto."""
    return StepResult(
        msg.step,
        [
            EntryResult(
                r.rid,
                r.token_id,
                r.logprob,
                _top_from_proto(r.top_logprobs),
                r.input_logprobs_start,
                list(r.input_logprobs),
                [_top_from_proto(t) for t in r.input_top_logprobs],
                list(r.forced_ids),
                list(r.accepted_ids),
                list(r.accepted_logprobs),
                [_top_from_proto(t) for t in r.accepted_top_logprobs],
                list(r.embedding),
            )
            for r in msg.results
        ],
        msg.forward_ms,
        list(msg.copies_done),
        [(g.kind, g.text) for g in msg.grammars_ready],
        [((f.constraint.kind, f.constraint.text), f.error) for f in msg.grammars_failed],
        [SendOutcome(o.rid, o.error, o.bytes, o.ms) for o in msg.sends_done],
        ints(msg.decode_tokens),
    )


def ints(packed: bytes) -> array[int]:
    """A packed int32 field back as an array."""
    values = int_array()
    values.frombytes(packed)
    return values


class PackedUpdate(NamedTuple):
    """One entry of a TokenStep's PackedUpdates."""

    rid: str
    seq: int
    offset: int
    route: int  # index in the message's reply_to and detok
    context: array[int]
    new: array[int]


class PackedChunk(NamedTuple):
    """One entry of a TextChunks' PackedChunks."""

    rid: str
    seq: int
    text: str
    ids: array[int]
    completion_tokens: int


def packed_updates(p: mpb.PackedUpdates) -> Iterator[PackedUpdate]:
    """The entries of packed updates, in order."""
    contexts = _runs(ints(p.context_ids), ints(p.context_lens))
    news = _runs(ints(p.new_ids), ints(p.new_lens))
    for fields in zip(p.rids, ints(p.seqs), ints(p.offsets), ints(p.routes), contexts, news,
                      strict=True):
        yield PackedUpdate(*fields)


def packed_chunks(p: mpb.PackedChunks) -> Iterator[PackedChunk]:
    """The entries of packed chunks, in order."""
    ids = _runs(ints(p.ids), ints(p.id_lens))
    for fields in zip(p.rids, ints(p.seqs), p.texts, ids, ints(p.completion_tokens),
                      strict=True):
        yield PackedChunk(*fields)


def _runs(values: array[int], lengths: array[int]) -> Iterator[array[int]]:
    """`values` cut into consecutive runs of `lengths`."""
    end = 0
    for n in lengths:
        start, end = end, end + n
        yield values[start:end]
