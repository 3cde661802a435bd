"""The decode half of a step: every running request's next token, packed where it can be
(StepBatch.decode_rows), drafted where speculation says, and room made for it by evicting,
retracting or cutting short when the pool is full; and the packed decodes' tokens folded
back into their requests."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Protocol

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.step import StepEntry, StepResult
from radixmesh.engine.kv_holdings import KVHoldings
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler_config import SchedulerConfig
from radixmesh.engine.speculation import Draft, NoSpeculation

if TYPE_CHECKING:
    from radixmesh.engine.scheduler import ScheduledBatch


class DecodeQueues(Protocol):
    """What the decode steps need of the scheduler: its running requests, and what it does
    when one cannot go on or has its token."""

    running: list[Req]

    def retract_for_room(self, req: Req) -> None: ...

    def finish(self, req: Req, reason: FinishReason) -> None: ...

    def changed(self, req: Req) -> None: ...

    def changed_all(self, reqs: list[Req]) -> None: ...

    def settled(self, req: Req) -> None: ...


class Decodes:
    """The decode half of every step and of its result, a collaborator of the Scheduler:
    its requests through `queues`, their slots through `kv`."""

    def __init__(self, config: SchedulerConfig, kv: KVHoldings, speculation: NoSpeculation,
                 queues: DecodeQueues) -> None:
        self.config = config
        self.kv = kv
        self.page = kv.page
        self.speculation = speculation
        self.queues = queues

    def schedule(self, batch: ScheduledBatch) -> None:
        """Every running request's next token into `batch`, room made where it lacks."""
        spare = self._decode_pages()
        try:
            self._decode_each(batch, spare)
        finally:
            if spare:  # taken for requests that did not decode (retracted, finishing)
                self.kv.allocator.free(spare)
        self.kv.decoded(batch)

    def _decode_each(self, batch: ScheduledBatch, spare: deque[int]) -> None:
        running = self.queues.running
        context, page, drafting = self.config.context_length, self.page, self.speculation.drafting
        rows, decode_slots, decodes = (batch.batch.decode_rows, batch.batch.decode_slots,
                                       batch.decodes)
        i = 0
        while i < len(running):
            req = running[i]
            held = req.slots
            have = len(held)
            if (req.params.max_new_tokens - len(req.output_ids) - req.pending <= 0
                    or have >= context):
                i += 1  # its last token is in flight; the result will finish it
                continue
            draft: Draft | None = None
            slots: list[int] | None = None
            if drafting and not req.jumped and self.speculation.drafts(req):
                if req.pending:
                    i += 1  # its draft starts from the token in flight (a verify's too)
                    continue
                draft, slots = self._draft(req)
            # Tokens known but not yet fed: after a jump-forward, the sampled token (unless
            # the step in flight feeds it) and the forced ones. Otherwise only the token in
            # flight or the last one sampled, which the runner feeds itself.
            unfed = req.tokens[have:] if req.jumped else []
            if draft is None and not unfed and req.packs:
                # The usual decode, packed: its slot in its partial last page, or a spare
                # fresh one (else one from the pool, below).
                slot = -1
                if have % page and have > req.cached_len:
                    slot = held[-1] + 1
                elif spare:
                    slot = spare.popleft()
                if slot >= 0:
                    held.append(slot)
                    rows.append(req.row)
                    decode_slots.append(slot)
                    decodes.append(req)
                    req.pending += 1
                    i += 1
                    continue
            if slots is None:
                slots = self.kv.grow(req, max(len(unfed), 1))
            if slots is None and self.kv.cache.pending_backups():
                # Backups pin device slots (and every prefix above them) for a step or two:
                # wait for them rather than retract or cut a request short.
                i += 1
                continue
            if slots is None and len(running) == 1:
                # Alone and still out of room: it could never be readmitted either.
                self.queues.finish(
                    req, FinishReason(FinishKind.LENGTH, len(req.output_ids), "KV pool full")
                )
                break
            if slots is None:
                victim = running[-1]
                self.queues.retract_for_room(victim)
                if victim is req:
                    break
                continue
            if draft is None and not unfed and req.packs:
                rows.append(req.row)
                decode_slots.append(slots[0])
                decodes.append(req)
                req.pending += 1
                i += 1
                continue
            entry = StepEntry(req.rid, unfed, slots, True)
            if draft is not None:
                entry.draft, entry.draft_parents = draft
            batch.batch.entries.append(entry)
            batch.reqs.append(req)
            if req.jumped:
                batch.jumps.add(req.rid)
                req.jumped = False
            req.pending += 1
            i += 1

    def _draft(self, req: Req) -> tuple[Draft | None, list[int] | None]:
        """A draft to verify after the request's last token, with a slot for that token and
        each draft token; (None, None) when it drafts nothing or there is no room."""
        limit = min(
            req.remaining_new_tokens() - 1,  # the step adds a token of its own
            self.config.context_length - len(req.slots) - 1,
        )
        draft = self.speculation.draft(req, limit, len(self.queues.running))
        slots = None if draft is None else self.kv.grow(req, 1 + len(draft.tokens))
        return (draft, slots) if slots is not None else (None, None)

    def _decode_pages(self) -> deque[int]:
        """Fresh pages for the step's decodes that start a page (first slots), taken from the
        free ones in one go; more come one at a time, with eviction, if these run out."""
        page = self.page
        if page == 1:
            need = len(self.queues.running)
        else:
            need = sum(1 for r in self.queues.running if len(r.slots) % page == 0
                       or len(r.slots) <= r.cached_len)
        allocator = self.kv.allocator
        take = min(need, allocator.available() // page)
        fresh = allocator.alloc(take * page) if take else None
        return deque(fresh[::page] if fresh else ())

    def fold(self, decodes: list[Req], result: StepResult) -> None:
        """Fold in the packed decodes' tokens: no logprobs, drafts or forced tokens there."""
        eos, context = self.config.eos_token_ids, self.config.context_length
        queues = self.queues
        folded = []
        for req, token in zip(decodes, result.decode_tokens, strict=True):
            req.pending -= 1
            if req.finish is not None:
                queues.settled(req)
                continue  # a step run ahead past the finish; its token is dropped
            output = req.output_ids
            output.append(token)
            folded.append(req)
            p = req.params
            # Req.stop_reason only where the token may end it: a stop id, or a length limit.
            if (token in eos or token in p.stop_token_ids or len(output) >= p.max_new_tokens
                    or len(req.input_ids) + len(output) >= context):
                reason = req.stop_reason(token, eos, context)
                if reason is not None:
                    queues.finish(req, reason)
        queues.changed_all(folded)
