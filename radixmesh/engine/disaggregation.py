"""Prefill/decode disaggregation, as the scheduler of either side does it.

A request comes to its decode engine naming its prefill engine. The decode side matches the
prompt against its own prefix cache, sets aside slots for the rest of the prompt and tells
its worker to accept KV for them (a KVExpect); the service then sends the request on to the
prefill engine with those slots (a Handoff). The prefill side prefills the prompt as usual,
samples the first token, and sends the prompt's KV from its worker straight into those
slots (a KVSend, after the step that computed it); once every rank has sent and the token
is in, it hands the token back (the service's KVCommit) and keeps the prompt cached. The
decode side then puts the prompt into its radix tree and queues the request with its first
token: admission finds the whole prompt cached and decoding goes on as for any request.

Every failure ends in a local prefill on the decode engine (the transfer's fallback): a
send that fails, a prefill engine that goes away or answers too late. A slot is never
reused while KV may still be written into it: the decode worker refuses KV for a request
once its scheduler released it, and its writes and steps run on one thread in order."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.step import KVExpect, KVSend, SendOutcome, StepBatch, kv_key
from radixmesh.engine.request import Req

if TYPE_CHECKING:
    from radixmesh.engine.kv_holdings import KVHoldings
    from radixmesh.engine.scheduler_config import SchedulerConfig


def handoff_key(rid: str, decode_engine: str) -> str:
    """A prefill engine's id for a request it prefills for `decode_engine`: the client's
    request may be on this engine as well, retried here after that decode engine was lost."""
    return f"{rid}>{decode_engine}"


@dataclass
class Handoff:
    """Prefill side: where a request's prompt KV goes, and how far it got."""

    rid: str  # the client's id (the decode engine's)
    decode_engine: str
    start: int  # prompt tokens the decode engine holds already
    dest_slots: list[int]  # its slots for prompt tokens [start, end)
    dest_workers: list[str]  # its worker ranks, rank 0 first
    dest_host: str  # their host (shared memory needs the same one)
    key: str
    backend: str = "grpc"  # set by the prefill engine: "grpc" or "shm"
    sent: SendOutcome | None = None  # once every rank has sent (or one failed)
    sampled: bool = False  # the first token(s) are in
    finish: FinishReason | None = None  # the request ended with them

    @property
    def done(self) -> bool:
        """The KV has gone (or failed to) and the first token is in: hand it back."""
        return self.sent is not None and self.sampled


@dataclass
class Transfer:
    """Decode side: a request whose prompt KV comes from a prefill engine."""

    prefill_engine: str
    deadline: float = 0.0  # monotonic; set when its slots are set aside
    tokens: int = 0  # prompt tokens whose KV arrived
    bytes: int = 0
    ms: float = 0.0
    fallback: str = ""  # why the prompt was prefilled here after all


@dataclass
class Committed:
    """What a prefill engine hands back: the first token(s), or why the KV did not come."""

    error: str = ""
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: list[float] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: FinishReason | None = None
    bytes: int = 0
    ms: float = 0.0


@dataclass
class Reservation:
    """Slots a decode engine set aside for a prompt's KV, for the service to send on."""

    req: Req
    start: int
    dest_slots: list[int]
    key: str


class Disaggregation:
    """Both sides' state; an engine serves either side for any request that asks (its
    mode only says which requests routers send it)."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self.reset()

    def reset(self) -> None:
        """Forget everything (the model runners are gone)."""
        # Prefill side: requests whose KV is being sent, by rid (finished ones too, until
        # their send is over: their slots are read until then).
        self.handing: dict[str, Req] = {}
        # Decode side: requests waiting for slots, then for their KV.
        self.reserving: list[Req] = []
        self.awaiting: dict[str, Req] = {}
        self._reservations: list[Reservation] = []
        self._cancelled: list[tuple[str, str]] = []  # (rid, prefill engine) to abort there
        self.sends: list[KVSend] = []  # for the next step
        self.expects: list[KVExpect] = []
        self.transfers_ok = 0
        self.transfers_failed = 0

    def has_work(self) -> bool:
        """Whether a step is needed: to set slots aside, or to hear of sends."""
        return bool(self.reserving or self.sends or self.expects or self.sending())

    def sending(self) -> bool:
        """Whether a worker is still sending some request's KV (a step hears when done)."""
        return any(r.handoff is not None and r.handoff.sent is None
                   for r in self.handing.values())

    def take_into(self, step: StepBatch) -> None:
        """Put the sends and expects gathered since the last step into `step`."""
        step.sends, self.sends = self.sends, []
        step.expects, self.expects = self.expects, []

    # ---- prefill side -------------------------------------------------------------------

    def prefilled(self, req: Req) -> None:
        """The step scheduled now computes the last of `req`'s prompt and samples its first
        token: send the prompt's KV after it."""
        handoff = req.handoff
        assert handoff is not None
        self.handing[req.rid] = req
        slots = req.slots[handoff.start : len(req.input_ids)]
        if not slots:  # the decode engine has the whole prompt
            handoff.sent = SendOutcome(req.rid)
            return
        self.sends.append(KVSend(req.rid, slots, handoff.dest_slots, handoff.dest_workers,
                                 handoff.key, handoff.backend, handoff.rid))

    def sent(self, outcomes: list[SendOutcome]) -> list[Req]:
        """Sends the workers finished; the requests now done (handed back or, finished
        meanwhile, free to release)."""
        done = []
        for outcome in outcomes:
            req = self.handing.get(outcome.rid)
            if req is None or req.handoff is None:
                continue
            req.handoff.sent = outcome
            if outcome.error:
                self.transfers_failed += 1
            else:
                self.transfers_ok += 1
            if req.handoff.done or req.finish is not None:
                done.append(self.handing.pop(req.rid))
        return done

    def sampled(self, req: Req, finish: FinishReason | None) -> bool:
        """`req`'s first token(s) are in (ending it when `finish`); True once it can be
        handed back (its KV is sent)."""
        assert req.handoff is not None
        req.handoff.sampled, req.handoff.finish = True, finish
        if req.handoff.done:
            self.handing.pop(req.rid, None)
            return True
        return False

    def reading(self, req: Req) -> bool:
        """Whether a worker may still read `req`'s slots for a send."""
        return req.rid in self.handing and req.handoff is not None and req.handoff.sent is None

    def release_now(self, req: Req) -> bool:
        """`req` ended: whether its slots may go now (False while a send reads them; it is
        then released when the send is over)."""
        if self.reading(req):
            return False
        self.handing.pop(req.rid, None)
        return True

    # ---- decode side --------------------------------------------------------------------

    def arrived(self, req: Req) -> None:
        """A request whose prompt KV comes from a prefill engine: set slots aside first."""
        self.reserving.append(req)

    def reserved(self, req: Req, start: int, slots: list[int]) -> None:
        """Slots for prompt tokens [start, end) are set aside: expect the KV there."""
        transfer = req.transfer
        assert transfer is not None
        self.reserving.remove(req)
        transfer.deadline = time.monotonic() + self.timeout_s
        transfer.tokens = len(slots)
        key = kv_key(req.input_ids, start, req.namespace)
        self.awaiting[req.rid] = req
        if slots:
            self.expects.append(KVExpect(req.rid, slots, key))
        self._reservations.append(Reservation(req, start, slots, key))

    def take_reservations(self) -> list[Reservation]:
        """Requests to send on to their prefill engines, with their slots."""
        out, self._reservations = self._reservations, []
        return [r for r in out if r.req.finish is None and r.req.rid in self.awaiting]

    def waits_for_kv(self, req: Req) -> bool:
        """Whether `req` waits for slots or for its KV (decode side)."""
        return req.rid in self.awaiting or req in self.reserving

    def cancel(self, req: Req, why: str) -> None:
        """Stop waiting for `req`'s KV (tell its prefill engine to drop it)."""
        transfer = req.transfer
        assert transfer is not None
        self.awaiting.pop(req.rid, None)
        if req in self.reserving:
            self.reserving.remove(req)
        else:
            self._cancelled.append((req.rid, transfer.prefill_engine))
        transfer.fallback = why

    def take_cancelled(self) -> list[tuple[str, str]]:
        """(rid, prefill engine) of requests the prefill engine should drop."""
        out, self._cancelled = self._cancelled, []
        return out

    def expired(self, now: float | None = None) -> list[Req]:
        """Requests whose KV is overdue."""
        now = time.monotonic() if now is None else now
        return [r for r in self.awaiting.values()
                if r.transfer is not None and r.transfer.deadline < now]

    def from_engine(self, engine_id: str) -> list[Req]:
        """Requests waiting for slots or KV from `engine_id` (which went away)."""
        return [r for r in [*self.reserving, *self.awaiting.values()]
                if r.transfer is not None and r.transfer.prefill_engine == engine_id]


# How a prefill engine's request ends once its decode engine has it.
HANDED_BACK = FinishReason(FinishKind.ABORT, message="handed to its decode engine")


class RequestQueues(Protocol):
    """What the transfer steps need of the scheduler: its requests and queues, ending a
    request, and the two notes a step carries out (new output, a worker to forget)."""

    requests: dict[str, Req]
    running: list[Req]
    waiting: list[Req]

    def finish(self, req: Req, reason: FinishReason) -> None: ...

    def changed(self, req: Req) -> None: ...

    def release_on_worker(self, rid: str) -> None: ...


class Transfers:
    """The scheduler's own steps of disaggregation, a collaborator it holds: these act on
    its requests through `queues` and on their slots through `kv`."""

    def __init__(self, config: SchedulerConfig, kv: KVHoldings, disagg: Disaggregation,
                 queues: RequestQueues) -> None:
        self.config = config
        self.kv = kv
        self.disagg = disagg
        self.queues = queues

    def reserve(self) -> None:
        """Decode side: set slots aside for the prompts whose KV comes from prefill engines,
        oldest first, while there is room beside what running requests will need; fall back
        to prefilling here those whose KV is overdue."""
        for req in self.disagg.expired():
            self.fall_back(req, f"no KV from {req.transfer.prefill_engine} within "
                                 f"{self.disagg.timeout_s:g} s")  # type: ignore[union-attr]
        if not self.disagg.reserving:
            return
        # What the requests running, waiting and waiting for KV will still need: set aside
        # no more than leaves them room to decode.
        q = self.queues
        ahead = [*q.running, *q.waiting, *self.disagg.awaiting.values()]
        remaining = sum(r.remaining_new_tokens() for r in ahead)
        for req in list(self.disagg.reserving):
            match = self.kv.cache.match_prefix(req.input_ids, req.namespace)
            start = len(match.slots)
            need = -(-(len(req.input_ids) - start) // self.kv.page) * self.kv.page
            remaining += req.remaining_new_tokens()
            reserve = self.config.decode_reserve_ratio * remaining
            room = self.kv.allocator.available() + self.kv.cache.evictable_size()
            if ahead and room < need + reserve:
                return
            ahead.append(req)
            self.kv.cache.lock(match.node)
            fresh = self.kv.alloc(need) if need else []
            if fresh is None:
                self.kv.cache.unlock(match.node)
                return
            slots = fresh[: len(req.input_ids) - start]
            self.kv.hold(req, list(match.slots) + slots, start, match.node)
            req.cached_tokens = start
            self.disagg.reserved(req, start, slots)

    def commit(self, rid: str, committed: Committed) -> None:
        """Decode side: a prefill engine handed back `rid` (its KV arrived, or did not)."""
        req = self.queues.requests.get(rid)
        if req is None or req.finish is not None or rid not in self.disagg.awaiting:
            return
        if committed.error:
            self.fall_back(req, committed.error)
            return
        transfer = req.transfer
        assert transfer is not None
        del self.disagg.awaiting[rid]
        transfer.bytes, transfer.ms = committed.bytes, committed.ms
        self.queues.release_on_worker(rid)  # the worker takes no more KV for it
        # The prompt joins the tree (the partial last page is computed again at admission),
        # the most recently used prefix there: admission finds it before eviction reaches
        # it, and a pool too full to keep it meanwhile costs a recompute, never a stall.
        self.kv.release(req)
        req.output_ids = list(committed.output_ids)
        if req.logprobs.return_logprob:
            req.output_logprobs = list(committed.output_logprobs)
            req.output_top_logprobs = list(committed.output_top_logprobs)
            req.input_logprobs = list(committed.input_logprobs)
            req.input_top_logprobs = list(committed.input_top_logprobs)
        req.admitted = True  # its prompt logprobs are in
        self.queues.changed(req)
        if committed.finish is not None:
            self.queues.finish(req, committed.finish)
        else:
            self.queues.waiting.append(req)

    def lose_prefill_engine(self, engine_id: str) -> None:
        """Decode side: `engine_id` went away; prefill here what waited for it."""
        for req in self.disagg.from_engine(engine_id):
            self.fall_back(req, f"prefill engine {engine_id} went away")

    def fall_back(self, req: Req, why: str) -> None:
        """Decode side: give up on `req`'s KV transfer and prefill it here."""
        self.drop_reservation(req, why)
        self.queues.waiting.append(req)

    def drop_reservation(self, req: Req, why: str) -> None:
        """Free the slots set aside for `req`'s KV (never cached: what they hold is not
        known to be whole) and tell its worker and prefill engine."""
        reserved = req.rid in self.disagg.awaiting
        self.disagg.cancel(req, why)
        if not reserved:
            return
        self.queues.release_on_worker(req.rid)
        self.kv.unhold(req)
        req.cached_tokens = 0

    def hand_back(self, req: Req) -> None:
        """Prefill side: `req`'s KV is sent (or failed to) and its first token is in: it
        ends here (its prompt stays cached) and the service hands it to its decode engine."""
        assert req.handoff is not None
        self.queues.finish(req, req.handoff.finish or HANDED_BACK)
