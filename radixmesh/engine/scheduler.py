"""Continuous batching over a radix prefix cache: builds each step's StepBatch and folds
the model runner's StepResult back into the requests."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.hicache import HostPoolSpec
from radixmesh.core.step import EntryResult, StepBatch, StepEntry, StepResult
from radixmesh.engine.constraints import Constraints
from radixmesh.engine.decode_steps import Decodes
from radixmesh.engine.disaggregation import Disaggregation, Transfers
from radixmesh.engine.kv_allocator import KVAllocator
from radixmesh.engine.lora_adapters import LoraAdapters
from radixmesh.engine.priority import Capacity, KVRoom, make_priority
from radixmesh.engine.radix_cache import RadixCache
from radixmesh.engine.request import Req
from radixmesh.engine.schedule_policy import SchedulePolicy, match_key
from radixmesh.engine.scheduler_config import SchedulerConfig
from radixmesh.engine.speculation import make_speculation, tree_depth
from radixmesh.engine.state_snapshots import make_holdings
from radixmesh.engine.tiering import NoTiers, attached_tiers


@dataclass
class ScheduledBatch:
    """A batch on its way to the model runner, with the requests behind its entries."""

    batch: StepBatch
    reqs: list[Req] = field(default_factory=list)  # behind the batch's entries
    decodes: list[Req] = field(default_factory=list)  # behind its packed decodes
    jumps: set[str] = field(default_factory=set)  # decodes feeding jump-forward tokens

    @property
    def all_reqs(self) -> list[Req]:
        """Every request the step computes for: the packed decodes', then the entries'."""
        return [*self.decodes, *self.reqs]


class Scheduler:
    """Owns every request's place in line and the step it is in; collaborators hold the
    rest: what requests hold in the pool and the radix tree (KVHoldings), the tiers behind
    the device pool, the constraints, the LoRA adapters served (LoraAdapters), the steps of
    prefill/decode disaggregation (Transfers), the decode half of each step and result
    (Decodes)."""

    def __init__(self, config: SchedulerConfig) -> None:
        if config.num_slots % config.page_size:
            raise ValueError("num_slots must be a multiple of page_size")
        self.config = config
        self.page = config.page_size
        self.num_retractions = 0
        self.constraints = Constraints()
        self.speculation = make_speculation(config.speculative)
        self.priority = make_priority(config)
        self.disagg = Disaggregation(config.transfer_timeout)
        self.adapters = LoraAdapters(config.lora_names, config.max_loras_per_batch,
                                     config.lora_pinned)
        self.reset()

    def lose_all(self, reason: FinishReason) -> list[Req]:
        """The model runners are gone, and every request's KV with them: end each request
        with `reason` and start over (reset). Returns the requests that ended."""
        ended = [req for req in self.requests.values() if req.finish is None]
        for req in ended:
            req.finish = reason
        self.reset()
        return ended

    def reset(self) -> None:
        """Start over, as with fresh model runners: no request, no cached prefix, no host
        tier (attach it again), no compiled constraint, steps counted from 1 again."""
        config = self.config
        self.allocator = KVAllocator(config.num_slots, config.page_size)
        self.kv = make_holdings(self.allocator, config)
        self.cache: RadixCache = self.kv.cache
        self.policy = SchedulePolicy(config.schedule_policy, self.cache)
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # decoding, oldest first
        self.chunked: Req | None = None  # prompt partly prefilled, continued first next step
        self.requests: dict[str, Req] = {}
        self.transfers = Transfers(config, self.kv, self.disagg, self)
        self.decodes = Decodes(config, self.kv, self.speculation, self)
        self._host_pool: HostPoolSpec | None = None  # to send with the next step
        self._release: list[str] = []
        self._free_rows: list[int] = []  # rows of the worker's request table, given back
        self._rows = 0  # rows handed out so far
        self._updated: dict[str, Req] = {}
        self.constraints.reset()
        self.speculation.reset()
        self.disagg.reset()
        self._step = 0

    @property
    def tiers(self) -> NoTiers:
        """The host and storage tiers, while attached (KVHoldings keeps them informed)."""
        return self.kv.tiers

    # ---- requests in and out -------------------------------------------------------

    def add_request(self, req: Req) -> None:
        """Queue a tokenized request; raises ValueError when it can never run."""
        if not req.input_ids:
            raise ValueError("input_ids must not be empty")
        if req.rid in self.requests:
            raise ValueError(f"duplicate request id {req.rid!r}")
        if len(req.input_ids) >= self.config.context_length:
            raise ValueError(
                f"prompt has {len(req.input_ids)} tokens; the context length is "
                f"{self.config.context_length}"
            )
        if len(req.input_ids) + 1 > self.config.num_slots - self.page:
            raise ValueError(f"prompt of {len(req.input_ids)} tokens exceeds the KV pool")
        self.adapters.check(req)
        handoff = req.handoff
        if handoff is not None and len(handoff.dest_slots) != len(req.input_ids) - handoff.start:
            raise ValueError(
                f"the decode engine set aside {len(handoff.dest_slots)} slots for "
                f"{len(req.input_ids) - handoff.start} prompt tokens"
            )
        self.requests[req.rid] = req
        if req.transfer is not None:
            self.disagg.arrived(req)
        else:
            self.waiting.append(req)
        self.tiers.ask(req)
        self.constraints.ask(req)

    def abort(self, rid: str, reason: FinishReason | None = None) -> bool:
        """Finish a request wherever it is; False if it is unknown or already finished."""
        req = self.requests.get(rid)
        if req is None or req.finish is not None:
            return False
        self.finish(req, reason or FinishReason(FinishKind.ABORT, message="aborted"))
        return True

    def drain_updates(self) -> list[Req]:
        """Requests that gained tokens or finished since the last call."""
        updated = list(self._updated.values())
        self._updated.clear()
        return updated

    def has_work(self) -> bool:
        """Whether a step would do anything."""
        return bool(
            self.waiting
            or self.running
            or self.chunked
            or self._release
            or self._host_pool is not None
            or self.constraints.compiling
            or self.tiers.has_copies()
            or self.cache.pending_backups() > 0
            or self.disagg.has_work()
        )

    def num_running(self) -> int:
        """Requests prefilling or decoding."""
        return len(self.running) + (self.chunked is not None)

    def stats(self) -> dict[str, int]:
        """Pool, cache and queue occupancy, as /server_info reports it."""
        return {
            "num_slots": self.config.num_slots,
            "free_slots": self.allocator.available(),
            "cached_tokens": self.cache.total_size(),
            "evictable_tokens": self.cache.evictable_size(),
            "held_slots": self.held_slots(),
            "running": self.num_running(),
            "waiting": len(self.waiting) + len(self.disagg.reserving),
            "num_retractions": self.num_retractions,
            **self.priority.stats(),
            "steps": self._step,
            "forced_tokens": self.constraints.forced_tokens,
            **self.speculation.stats.report(),
            **self.tiers.stats(self.cache),
            **self.kv.snapshot_stats(),
        }

    # ---- the host tier ---------------------------------------------------------------

    def attach_host(self, spec: HostPoolSpec) -> None:
        """A host pool to back the device pool, from the next step on (a new one replaces
        the last, whose contents are forgotten)."""
        self.kv.tiers = attached_tiers(self.cache, spec, self.config)
        self._host_pool = spec

    def detach_host(self) -> None:
        """The host pool is gone: serve from the device tier alone."""
        self.cache.drop_host()
        self.kv.tiers = NoTiers()
        self._host_pool = None

    def flush_cache(self) -> bool:
        """Drop every cached prefix; only possible while no request holds any."""
        if (self.running or self.chunked or any(r.slots for r in self.waiting)
                or self.kv.locked):
            return False
        self.cache.reset()
        self.tiers.take_copies()  # unsent backups of what the flush dropped
        return True

    # ---- building a step -----------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch: every decoding request, then prefill under the budget."""
        batch = ScheduledBatch(StepBatch(self._step + 1))
        self._preempt()
        self.decodes.schedule(batch)
        self._schedule_prefills(batch)
        self.transfers.reserve()  # room for later work, after what can run now
        step = batch.batch
        # Taken last: a request retracted by this very step may be readmitted by it too,
        # and the runner forgets before it admits.
        step.release, self._release = self._release, []
        step.saves = self.kv.take_saves()
        step.copies = self.tiers.take_copies()
        step.host_pool, self._host_pool = self._host_pool, None
        step.grammars = self.constraints.take()
        self.disagg.take_into(step)
        # Backups and KV sends hold device slots until a step reports them done, and
        # compiles end in a step's result: an empty step still collects those reports.
        if (
            not batch.reqs
            and not batch.decodes
            and not step.release
            and not step.copies
            and step.host_pool is None
            and not step.sends
            and not step.expects
            and not self.cache.pending_backups()
            and not self.constraints.compiling
            and not self.disagg.sending()
        ):
            return None
        self._step += 1  # steps count 1, 2, 3... so a worker can put them back in order
        return batch

    def _schedule_prefills(self, batch: ScheduledBatch) -> None:
        budget = self.config.chunked_prefill_size
        if self.chunked is not None:
            used = self._extend(batch, self.chunked, budget)
            if not used or self.chunked is not None:
                return
            budget -= used
        for req in self.priority.order(self.waiting, self.policy.order):
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if not self._ready(req) or not self.adapters.fits(req, self.running):
                continue
            used = self._admit(batch, req, budget)
            if not used:
                break
            budget -= used
            if self.chunked is not None:
                break

    def _ready(self, req: Req) -> bool:
        """Whether a waiting request may be admitted now: no token of it in flight (retracted
        mid-step), its constraint compiled, its prefix not on its way from storage."""
        return not req.pending and self.constraints.ready(req) and (
            req.admitted or not self.tiers.waits(req))

    def _preempt(self) -> None:
        """Retract the running requests that more important waiting ones displace (priority
        scheduling); before decodes are scheduled, so that none of them is in the step."""
        if self.chunked is not None:
            return  # the prompt being prefilled in chunks takes this step's admission
        c = self.config
        free = Capacity(c.max_running_requests - len(self.running), c.chunked_prefill_size)
        room = KVRoom(self.cache, self.allocator, self.page, c.decode_reserve_ratio,
                      self.kv.locked)
        for victim in self.priority.victims(self.waiting, self.running, self._ready, free, room):
            self._retract(victim)

    def _admit(self, batch: ScheduledBatch, req: Req, budget: int) -> int:
        """Take a waiting request into the batch; returns prompt tokens scheduled (0: no room)."""
        match = self.cache.match_prefix(match_key(req), req.namespace)
        self.cache.lock(match.node)
        node, prefix, loaded = match.node, list(match.slots), 0
        if match.host_nodes and match.host_len < self.config.num_slots:
            # Loading beats recomputing whenever there is room: a copy per token, not a
            # forward pass. Room frees up as running requests finish and backups land, so
            # wait for it rather than recompute; alone, recompute in chunks.
            fresh = self.kv.alloc(match.host_len)
            if fresh is None and (self.running or self.cache.pending_backups()):
                self.cache.unlock(node)
                return 0
            if fresh is not None:
                self.tiers.load(match.host_nodes, fresh)
                node = match.host_nodes[-1]
                self.cache.lock(node)
                self.cache.unlock(match.node)
                prefix += fresh
                loaded = len(fresh)
        self.tiers.admitted(node)
        chunk = min(req.num_tokens - len(prefix), budget)
        reserve = self.config.decode_reserve_ratio * sum(
            r.remaining_new_tokens() for r in [*self.running, req]
        )
        room = self.allocator.available() + self.cache.evictable_size()
        if self.running and room < chunk + self.page + reserve:
            self.cache.unlock(node)
            return 0
        cached = len(prefix)
        self.kv.hold(req, prefix, cached, node)
        req.row = self._free_rows.pop() if self._free_rows else self._next_row()
        new_request = req.new_request(cached, self.kv.snapshot_of(node))
        used = self._extend(batch, req, budget)
        if not used:
            self.kv.unhold(req)
            self._free_rows.append(req.row)
            req.row = -1
            return 0
        self.waiting.remove(req)
        req.jumped = False  # its prefill feeds every token it has
        if not req.admitted:
            req.admitted = True
            req.cached_tokens = cached
            req.cached_storage_tokens = min(req.storage_tokens, loaded)
            req.cached_host_tokens = loaded - req.cached_storage_tokens
        batch.batch.new_requests.append(new_request)
        req.on_worker = True
        return used

    def _extend(self, batch: ScheduledBatch, req: Req, budget: int) -> int:
        """Schedule a request's next prompt chunk; returns its length (0: no room, nothing done)."""
        start = len(req.slots)
        chunk = min(req.num_tokens - start, budget)
        slots = self.kv.grow(req, chunk)
        if slots is None:
            return 0
        done = start + chunk == req.num_tokens
        batch.batch.entries.append(
            StepEntry(req.rid, req.tokens[start : start + chunk], slots, done)
        )
        batch.reqs.append(req)
        self.kv.cache_progress(req, chunk)
        if done:
            self.chunked = None
            req.pending += 1
            if req.handoff is not None:
                self.disagg.prefilled(req)  # its first token is all this engine samples
            else:
                self.running.append(req)
        else:
            self.chunked = req
        return chunk

    # ---- leaving and ending ------------------------------------------------------------

    def retract_for_room(self, req: Req) -> None:
        """Retract a running request to make room for the others' decodes (counted)."""
        self.num_retractions += 1
        self._retract(req)

    def _retract(self, req: Req) -> None:
        """Send a running request back to the queue; its progress stays as a cached prefix."""
        self.running.remove(req)
        self.kv.release(req)
        self._forget_on_worker(req)
        self.waiting.append(req)

    def changed(self, req: Req) -> None:
        """Its output or its finish changed: the next drain_updates has it."""
        self._updated[req.rid] = req

    def changed_all(self, reqs: list[Req]) -> None:
        """`changed` for each of them."""
        self._updated.update({req.rid: req for req in reqs})

    def release_on_worker(self, rid: str) -> None:
        """The worker forgets the request's state with the next step."""
        self._release.append(rid)

    def _forget_on_worker(self, req: Req) -> None:
        if req.on_worker:
            self.release_on_worker(req.rid)
            req.on_worker = False
            self._free_rows.append(req.row)  # reused no earlier than the step releasing it
            req.row = -1

    def _next_row(self) -> int:
        self._rows += 1
        return self._rows - 1

    def finish(self, req: Req, reason: FinishReason) -> None:
        """End a request with `reason`, wherever it is."""
        req.finish = reason
        self.tiers.forget(req)
        self.speculation.forget(req)
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        if req in self.waiting:
            self.waiting.remove(req)
        if self.disagg.waits_for_kv(req):
            self.transfers.drop_reservation(req, reason.message or "the request ended")
        # A worker still sending its KV reads its slots: released when the send is over.
        if self.disagg.release_now(req) and (req.slots or req.rid in self.kv.locked):
            self.kv.release(req)
        self._forget_on_worker(req)
        self.changed(req)
        self.settled(req)

    def settled(self, req: Req) -> None:
        """Drop a finished request once no step of it is still in flight and no worker
        reads its slots."""
        if not req.pending and not self.disagg.reading(req):
            self.requests.pop(req.rid, None)

    # ---- results ---------------------------------------------------------------------

    def process_result(self, batch: ScheduledBatch, result: StepResult) -> None:
        """Append sampled tokens and logprobs; finish requests that hit a stop or a limit."""
        self.tiers.done(result.copies_done)
        for req in self.disagg.sent(result.sends_done):
            if req.finish is None:
                self.transfers.hand_back(req)
            else:  # ended while its KV was sent: its slots are free to go now
                self.kv.release(req)
                self.settled(req)
        self._compiles_ended(result)
        self.speculation.stepped(batch.batch, result.forward_ms)
        self.decodes.fold(batch.decodes, result)
        for req, entry, out in zip(batch.reqs, batch.batch.entries, result.results, strict=True):
            if out.input_logprobs:
                req.input_logprobs.extend(out.input_logprobs)
                req.input_top_logprobs.extend(out.input_top_logprobs)
            if out.token_id < 0 and not out.embedding:
                continue
            req.pending -= 1
            if req.finish is not None:
                self.settled(req)
                continue  # a step run ahead past the finish; its token is dropped
            if req.params.max_new_tokens == 0:  # prefill only (an embedding's too): no token
                req.embedding = out.embedding or None
                self.finish(req, FinishReason(FinishKind.LENGTH, 0))
                continue
            reason = None
            if entry.draft:
                self._verified(req, entry, out)
                for j, token in enumerate(out.accepted_ids):
                    logprob = out.accepted_logprobs[j] if out.accepted_logprobs else 0.0
                    top = out.accepted_top_logprobs[j] if out.accepted_top_logprobs else []
                    if reason := self._emit(req, token, logprob, top):
                        break
            reason = reason or self._emit(req, out.token_id, out.logprob, out.top_logprobs)
            self._updated[req.rid] = req
            if out.forced_ids and reason is None:
                reason = self.constraints.jump_forward(req, out.forced_ids, self._check_finish)
            if req.handoff is not None:
                if self.disagg.sampled(req, reason):
                    self.transfers.hand_back(req)
            elif reason is not None:
                self.finish(req, reason)

    def _emit(
        self, req: Req, token: int, logprob: float, top: list[tuple[int, float]]
    ) -> FinishReason | None:
        """Append one output token (and its logprobs, when asked); why it ends the request."""
        req.output_ids.append(token)
        if req.logprobs.return_logprob:
            req.output_logprobs.append(logprob)
            req.output_top_logprobs.append(top)
        return self._check_finish(req, token)

    def _verified(self, req: Req, entry: StepEntry, out: EntryResult) -> None:
        """Account a verify step, and give back the slots of the drafts it rejected (a
        request retracted meanwhile holds none)."""
        drafted, accepted = len(entry.draft), len(out.accepted_ids)
        req.spec_verify_ct += 1
        req.spec_accepted_tokens += accepted
        self.speculation.verified(req, drafted, tree_depth(entry.draft_parents), accepted)
        if req.slots:  # else retracted while the verify ran: its slots are released
            self.kv.trim(req, len(req.slots) - (drafted - accepted))

    def _compiles_ended(self, result: StepResult) -> None:
        self.constraints.ended(result.grammars_ready, result.grammars_failed)
        for grammar, error in result.grammars_failed:
            for req in [r for r in self.waiting if r.params.grammar == grammar]:
                self.finish(req, FinishReason(FinishKind.ABORT, message=error, status=400))

    def _check_finish(self, req: Req, token: int) -> FinishReason | None:
        return req.stop_reason(token, self.config.eos_token_ids, self.config.context_length)

    # ---- invariants --------------------------------------------------------------------

    def held_slots(self) -> int:
        """Slots owned by requests (not the tree, not free)."""
        return self.kv.held_slots(self.requests.values())

    def check_invariants(self) -> None:
        """free + cached + held == pool; evictable + protected == cached; tree consistent;
        no request keeps a slot past its tokens once its steps are back (a rejected draft's)."""
        self.kv.check_invariants(self.requests.values(), self.running, self.config.num_slots)
        self.tiers.check_invariants(self.cache)
