"""Prefill/decode disaggregation between two schedulers in one process: a decode side D and
a prefill side P, each with its own worker, and the messages the two scheduler services
would exchange passed by hand through their real conversions (mesh_io).

The workers are fake_worker's model-free worker plus what services/worker adds for
transfers: a KVInbox fed by the steps' expects and releases, and each step's sends read out
of the pool after the step and written into the decode worker's slots (when its inbox
admits them) some steps later. The fake worker's pool records which (token, position) each
slot holds and checks every request's slots on every step, so a transfer into the wrong
slots, a reservation freed too early or a prompt not transferred at all fails loudly. One
test runs two real tiny model runners instead, moving the KV with KVPorter, so that a wrong
transfer would change the tokens."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fake_worker import JUMPING, FakeWorker, Jump, reference_output
from tiny_model import KV_HEADS, save_tiny_model

import radixmesh.engine.disaggregation as disaggregation
from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.sampling_params import SamplingParams
from radixmesh.core.step import KVExpect, KVSend, SendOutcome, StepBatch, StepResult, kv_key
from radixmesh.engine.disaggregation import HANDED_BACK, Reservation, handoff_key
from radixmesh.engine.model.kv_transfer import KVInbox, KVPorter, head_overlaps
from radixmesh.engine.model.model_source import load_model
from radixmesh.engine.model.runner import ModelRunner
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler import ScheduledBatch, Scheduler
from radixmesh.engine.scheduler_config import SchedulerConfig
from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.proto.convert import sampling_to_proto
from radixmesh.services.scheduler.mesh_io import (
    commit_to_proto,
    committed_from_proto,
    handoff_request,
    request_from_proto,
)

PREFILL, DECODE = "P", "D"
WORKERS = ["w0"]  # the decode engine's worker ranks
HOST = "host-a"
MAX_TICKS = 5_000


# ---- workers ------------------------------------------------------------------------------


class Wire:
    """A worker's side of KV transfers, as services/worker does them: what it accepts (an
    inbox fed by expects, emptied by releases) and the sends of each step, read out of the
    pool after the step and delivered `delay` steps later (0: reported with the step itself).
    Sends are known by the decode engine's request id (the client's): one to a rid in
    `fail` fails with that error, one to a rid in `hold` waits until let go."""

    def __init__(self, delay: int = 1) -> None:
        self.inbox = KVInbox()
        self.delay = delay
        self.peers: dict[str, Wire] = {}
        self.outbox: list[tuple[int, KVSend, Any]] = []  # (step it lands at, send, data)
        self.fail: dict[str, str] = {}
        self.hold: set[str] = set()
        self.sent: list[KVSend] = []  # every send started, in order
        self.received: dict[str, int] = {}  # rid -> tokens written here

    def read(self, slots: list[int]) -> Any:
        """The KV of `slots` (a concrete worker's)."""
        raise NotImplementedError

    def write(self, slots: list[int], data: Any) -> None:
        """Put `data`, as read() gives it, into `slots`."""
        raise NotImplementedError

    def nbytes(self, data: Any) -> int:
        """The size of `data` on the wire."""
        raise NotImplementedError

    def before(self, batch: StepBatch) -> None:
        """The inbox's changes of a step, before its forward."""
        if batch.step == 1:
            self.inbox.clear()
        for rid in batch.release:
            self.inbox.release(rid)
        for expect in batch.expects:
            self.inbox.expect(expect)

    def after(self, batch: StepBatch, result: StepResult, step: int) -> None:
        """Read the step's sends, deliver those due, report them in `result`."""
        for send in batch.sends:
            self.sent.append(send)
            self.outbox.append((step + self.delay, send, self.read(send.slots)))
        for due, send, data in list(self.outbox):
            if due <= step and send.dest_rid not in self.hold:
                self.outbox.remove((due, send, data))
                result.sends_done.append(self.deliver(send, data))

    def deliver(self, send: KVSend, data: Any) -> SendOutcome:
        """Send `data` to the decode worker, which writes it if its inbox admits it."""
        if send.dest_rid in self.fail:
            return SendOutcome(send.rid, self.fail[send.dest_rid])
        peer = self.peers[send.dest_workers[0]]
        error = peer.inbox.admit(send.dest_rid, send.key, send.dest_slots, self.nbytes(data))
        if error:
            return SendOutcome(send.rid, error)
        peer.write(send.dest_slots, data)
        rid = send.dest_rid
        peer.received[rid] = peer.received.get(rid, 0) + len(send.dest_slots)
        return SendOutcome(send.rid, bytes=self.nbytes(data), ms=0.5)

    def sending(self, rid: str) -> bool:
        """Whether a send of `rid` is on its way."""
        return any(send.dest_rid == rid for _, send, _ in self.outbox)


class FakeKVWorker(FakeWorker, Wire):
    """The fake worker with transfers: the KV of a slot is its (token, position)."""

    def __init__(self, num_slots: int, delay: int = 1, jump: Jump | None = None) -> None:
        FakeWorker.__init__(self, num_slots, jump=jump)
        Wire.__init__(self, delay)

    def forward(self, batch: StepBatch) -> StepResult:
        """The fake worker's step between the inbox's changes and the sends."""
        self.before(batch)
        # A decode engine also releases requests its worker only took KV for (the inbox's);
        # the fake worker knows only those it ran.
        known = dataclasses.replace(batch, release=[r for r in batch.release if r in self.reqs])
        result = FakeWorker.forward(self, known)
        self.after(batch, result, self.steps)
        return result

    def read(self, slots: list[int]) -> list[tuple[int, int] | None]:
        """What each slot holds."""
        return [self.pool[s] for s in slots]

    def write(self, slots: list[int], data: list[tuple[int, int] | None]) -> None:
        """Each slot gets what the sender's held."""
        for slot, kv in zip(slots, data, strict=True):
            self.pool[slot] = kv

    def nbytes(self, data: list[tuple[int, int] | None]) -> int:
        """Eight bytes a token."""
        return 8 * len(data)


class RunnerKVWorker(Wire):
    """A real model runner with transfers through KVPorter: the sender reads its rank's
    heads, the receiver writes them in the pieces head_overlaps gives for `dest_ranks`
    ranks (all of them this one pool's)."""

    def __init__(self, runner: ModelRunner, delay: int = 1, dest_ranks: int = 1) -> None:
        super().__init__(delay)
        self.runner = runner
        self.porter = KVPorter(runner.pool, KV_HEADS)
        self.dest_ranks = dest_ranks
        self.steps = 0
        self.corrupt = False  # write every piece into the slots in reverse order

    def forward(self, batch: StepBatch) -> StepResult:
        """The runner's step between the inbox's changes and the sends."""
        self.steps += 1
        self.before(batch)
        result = self.runner.forward(batch)
        self.after(batch, result, self.steps)
        return result

    def read(self, slots: list[int]) -> torch.Tensor:
        """[2 * layers, tokens, heads, head_dim] of `slots`."""
        return self.porter.read(slots)

    def write(self, slots: list[int], data: torch.Tensor) -> None:
        """Write `data` a receiving rank's heads at a time, each piece checked first."""
        if self.corrupt:
            slots = slots[::-1]
        for _, a, b in head_overlaps(KV_HEADS, 1, self.dest_ranks, 0):
            piece = data[:, :, a:b].contiguous()
            dtype = str(piece.dtype).removeprefix("torch.")
            assert not self.porter.check(len(slots), a, b, piece.shape[0] // 2, dtype,
                                         piece.numel() * piece.element_size())
            self.porter.write(slots, a, piece)

    def nbytes(self, data: torch.Tensor) -> int:
        """The tensor's bytes."""
        return data.numel() * data.element_size()


# ---- one engine and the pair -----------------------------------------------------------


Worker = FakeKVWorker | RunnerKVWorker


class Side:
    """A scheduler and its worker, stepped as the engine loop does (with or without
    overlap); invariants are checked after every step."""

    def __init__(self, sched: Scheduler, worker: Worker, overlap: bool) -> None:
        self.sched, self.worker, self.overlap = sched, worker, overlap
        self.in_flight: tuple[ScheduledBatch, StepResult] | None = None
        self.batches: list[StepBatch] = []
        self.fed: dict[str, int] = {}  # tokens each request's entries fed

    def busy(self) -> bool:
        """Whether a step would do anything, or one is in flight."""
        return self.sched.has_work() or self.in_flight is not None

    def step(self) -> None:
        """Schedule a step, run it, process its result (the last one, with overlap)."""
        sched = self.sched
        batch = sched.schedule()
        if batch is not None:
            self.batches.append(batch.batch)
            for entry in batch.batch.entries:
                self.fed[entry.rid] = self.fed.get(entry.rid, 0) + len(entry.input_ids)
        if self.overlap:
            done = (batch, self.worker.forward(batch.batch)) if batch else None
            if self.in_flight is not None:
                sched.process_result(*self.in_flight)
            self.in_flight = done
        elif batch is not None:
            sched.process_result(batch, self.worker.forward(batch.batch))
        sched.check_invariants()


def config(num_slots: int = 1024, page_size: int = 1, chunk: int = 1024,
           **kw: Any) -> SchedulerConfig:
    """Either engine's scheduler configuration."""
    return SchedulerConfig(num_slots=num_slots, page_size=page_size,
                           chunked_prefill_size=chunk, **kw)


def engine_request(rid: str, prompt: list[int], max_new: int = 8, prefill: str = PREFILL,
                   logprobs: bool = False, **params: Any) -> mpb.EngineRequest:
    """What a tokenizer sends the decode engine (greedy; `prefill` names the prefill one;
    with `logprobs`, those of the output and the whole prompt with two alternatives)."""
    sampling = SamplingParams(max_new_tokens=max_new, temperature=0, **params)
    return mpb.EngineRequest(rid=rid, input_ids=prompt, sampling=sampling_to_proto(sampling, 0),
                             prefill_engine=prefill,
                             return_logprob=logprobs, top_logprobs_num=2 if logprobs else 0,
                             logprob_start_len=0 if logprobs else -1)


class Pair:
    """A decode engine D and a prefill engine P, and the services' messages between them:
    D's reservations go on to P as handoffs (handoff_request -> request_from_proto), D's
    cancels abort there, and P's finished handoffs come back as commits (commit_to_proto ->
    committed_from_proto -> D.transfers.commit). Messages pass after each engine's step;
    `hold_commits` keeps P's commits back until let go (a slow network)."""

    def __init__(self, d: Side, p: Side) -> None:
        self.d, self.p = d, p
        p.worker.peers = {WORKERS[0]: d.worker}
        self.messages: dict[str, mpb.EngineRequest] = {}  # as the decode service keeps them
        self.reservations: list[Reservation] = []
        self.handed: dict[str, Req] = {}  # P's requests by the client's rid
        self.cancelled: list[str] = []
        self.commits: list[mpb.KVCommit] = []  # every commit P sent
        self.held: list[mpb.KVCommit] = []
        self.hold_commits = False
        self.refused: list[str] = []  # handoffs P refused (as the service answers them)
        self.prefill_alive = True
        self.ticks = 0
        self.between: Callable[[], None] | None = None  # run after D's step, before messages

    @classmethod
    def fake(cls, overlap: bool = False, delay: int = 1, jump: Jump | None = None,
             **kw: Any) -> Pair:
        """Two engines alike, with fake workers."""
        cfg = config(**kw)
        return cls(Side(Scheduler(cfg), FakeKVWorker(cfg.num_slots, delay, jump), overlap),
                   Side(Scheduler(cfg), FakeKVWorker(cfg.num_slots, delay, jump), overlap))

    def submit(self, msg: mpb.EngineRequest) -> Req:
        """A request arrives at D."""
        req = request_from_proto(msg)
        self.messages[req.rid] = msg
        self.d.sched.add_request(req)
        return req

    def busy(self) -> bool:
        """Whether either engine has work, or D still waits for a prefill engine."""
        d = self.d.sched.disagg
        return (self.d.busy() or (self.prefill_alive and self.p.busy()) or bool(d.awaiting)
                or bool(self.held))

    def tick(self) -> None:
        """One step of each engine, with the messages passed after each."""
        self.ticks += 1
        assert self.ticks < MAX_TICKS, "no progress"
        self.d.step()
        if self.between is not None:
            self.between()
        self.exchange()
        if self.prefill_alive:
            self.p.step()
            self.exchange()

    def run(self, on_tick: Callable[[Pair], None] | None = None) -> None:
        """Tick until both engines are done, calling `on_tick` after each tick."""
        while self.busy():
            self.tick()
            if on_tick is not None:
                on_tick(self)

    def exchange(self) -> None:
        """What the two services' publish and callbacks do between steps."""
        d, p = self.d.sched, self.p.sched
        for r in d.disagg.take_reservations():
            self.reservations.append(r)
            assert r.req.transfer is not None
            if not self.prefill_alive or r.req.transfer.prefill_engine != PREFILL:
                continue  # gone, or another engine this pair does not run
            payload = handoff_request(self.messages[r.req.rid], DECODE, r.start,
                                      r.dest_slots, r.key, WORKERS, HOST)
            req = request_from_proto(mpb.EngineRequest.FromString(payload))
            try:
                p.add_request(req)
            except ValueError as exc:  # the prefill service hands it straight back
                self.refused.append(r.req.rid)
                self.commits.append(mpb.KVCommit(rid=r.req.rid, prefill_engine=PREFILL,
                                                 error=str(exc)))
                self.held.append(self.commits[-1])
                continue
            self.handed[r.req.rid] = req
        for rid, engine in d.disagg.take_cancelled():
            self.cancelled.append(rid)
            if engine == PREFILL and self.prefill_alive:
                p.abort(handoff_key(rid, DECODE))
        if self.prefill_alive:
            for req in p.drain_updates():
                if req.handoff is not None and req.finish is not None:
                    commit = mpb.KVCommit.FromString(
                        commit_to_proto(req, PREFILL).SerializeToString())
                    self.commits.append(commit)
                    self.held.append(commit)
        if not self.hold_commits:
            commits, self.held = self.held, []
            for commit in commits:
                d.transfers.commit(commit.rid, committed_from_proto(commit))

    def assert_idle(self) -> None:
        """Nothing is held on either side, nothing waits, both workers forgot everything."""
        sides = [self.d, self.p] if self.prefill_alive else [self.d]
        for side in sides:
            s = side.sched
            s.check_invariants()
            assert s.held_slots() == 0
            assert s.allocator.available() + s.cache.total_size() == s.config.num_slots
            assert s.cache.protected_size() == 0
            assert not s.requests and not s.waiting and not s.running and s.chunked is None
            dis = s.disagg
            assert not (dis.handing or dis.reserving or dis.awaiting)
            assert len(side.worker.inbox) == 0
            if isinstance(side.worker, FakeKVWorker):
                assert not side.worker.reqs, "a worker still holds released requests"
        if self.prefill_alive:
            assert not self.p.worker.outbox


def colocated(msgs: list[mpb.EngineRequest], cfg: SchedulerConfig, overlap: bool = False,
              worker: Worker | None = None) -> list[Req]:
    """The same requests on one scheduler that does both halves."""
    sched = Scheduler(cfg)
    side = Side(sched, worker or FakeKVWorker(cfg.num_slots), overlap)
    reqs = []
    for msg in msgs:
        plain = mpb.EngineRequest()
        plain.CopyFrom(msg)
        plain.prefill_engine = ""
        reqs.append(request_from_proto(plain))
        sched.add_request(reqs[-1])
    while side.busy():
        side.step()
    assert sched.held_slots() == 0
    return reqs


def prompts(n: int, seed: int, shared: int = 0) -> list[list[int]]:
    """`n` random prompts of 1 to 40 tokens after `shared` common ones."""
    rng = random.Random(seed)
    base = [rng.randrange(50) for _ in range(shared)]
    return [base + [rng.randrange(50) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def same_outputs(got: list[Req], want: list[Req]) -> None:
    """Each request has the tokens and finish of its counterpart."""
    for g, w in zip(got, want, strict=True):
        assert g.output_ids == w.output_ids, g.rid
        assert g.finish == w.finish, g.rid


# ---- 1. the same tokens as one engine doing both ----------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("chunk", [7, 1024])
def test_outputs_equal_one_engine_doing_both(overlap: bool, page_size: int, chunk: int) -> None:
    """Several requests at once, sharing a prefix: D decodes what P prefilled, token for
    token as one engine would; D computes only the prompt's partial last page itself."""
    pair = Pair.fake(overlap, page_size=page_size, chunk=chunk)
    msgs = [engine_request(f"r{i}", p, max_new=3 + i)
            for i, p in enumerate(prompts(10, seed=1, shared=12))]
    msgs[3].cache_salt = msgs[7].cache_salt = "tenant"  # their KV is named in the namespace
    reqs = [pair.submit(m) for m in msgs]
    pair.run()
    same_outputs(reqs, colocated(msgs, pair.d.sched.config, overlap))
    handoff = pair.handed["r3"].handoff
    assert handoff is not None and handoff.key == kv_key(reqs[3].input_ids, 0, "tenant")
    for req in reqs:
        assert req.transfer is not None and not req.transfer.fallback
        assert pair.d.worker.received[req.rid] == len(req.input_ids) - req.cached_tokens
        assert pair.d.fed[req.rid] == len(req.input_ids) % page_size + 1
    assert pair.p.sched.disagg.transfers_ok == len(reqs)
    assert not pair.cancelled and not pair.refused
    pair.assert_idle()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_one_request_alone(overlap: bool, page_size: int) -> None:
    """One request at a time, each sent as its predecessor ends: the KV goes once per
    request, into the slots D set aside, and comes back after the step that computed it."""
    pair = Pair.fake(overlap, page_size=page_size, chunk=7)
    for i, prompt in enumerate(prompts(4, seed=2)):
        msg = engine_request(f"a{i}", prompt, max_new=6)
        req = pair.submit(msg)
        pair.run()
        same_outputs([req], colocated([msg], pair.d.sched.config, overlap))
        send = pair.p.worker.sent[-1]
        assert send.dest_rid == req.rid and send.key == kv_key(prompt, 0, None)
        reservation = pair.reservations[-1]
        assert send.dest_slots == reservation.dest_slots
        assert len(send.dest_slots) == len(prompt)
        # The send rides on the step that computes the prompt's last chunk.
        step = next(b for b in pair.p.batches if b.sends and b.sends[0].rid == send.rid)
        last = [e for e in step.entries if e.rid == send.rid]
        assert len(last) == 1 and last[0].sample
        pair.assert_idle()


def forced_after_multiples_of_seven(tokens: list[int]) -> list[int]:
    """A stand-in grammar: after a sampled token divisible by 7, three more are forced."""
    last = tokens[-1]
    return [(last + k) % 50 for k in (11, 12, 13)] if last % 7 == 0 else []


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_forced_tokens_after_the_first_go_back_with_it(overlap: bool, page_size: int) -> None:
    """Jump-forward on P: tokens forced after the first sampled one come back in the commit
    and D feeds them all at admission. P serves its own requests meanwhile."""
    jump = forced_after_multiples_of_seven
    pair = Pair.fake(overlap, jump=jump, page_size=page_size, chunk=7)
    ps = prompts(30, seed=12, shared=3)
    msgs = [engine_request(f"r{i}", p, max_new=12, regex=JUMPING[1]) for i, p in enumerate(ps)]
    reqs = [pair.submit(m) for m in msgs]
    local = [Req(f"l{i}", p, SamplingParams(max_new_tokens=9, regex=JUMPING[1]), seed=0)
             for i, p in enumerate(prompts(5, seed=13, shared=3))]
    for req in local:
        pair.p.sched.add_request(req)
    pair.run()
    for req in [*reqs, *local]:
        assert req.output_ids == reference_output(req.input_ids, req.params.max_new_tokens,
                                                  jump=jump), req.rid
    forced = [c for c in pair.commits if len(c.output_ids) > 1]
    assert len(forced) >= 3 and all(len(c.output_ids) == 4 for c in forced)
    for commit in forced:  # D's first entry for it feeds the prompt's partial page and all four
        prompt = msgs[int(commit.rid[1:])].input_ids
        first = next(e for b in pair.d.batches for e in b.entries if e.rid == commit.rid)
        tail = len(prompt) % page_size
        assert first.input_ids == [*prompt[len(prompt) - tail:], *commit.output_ids]
    pair.assert_idle()


# ---- 2. turn two --------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_turn_two_sends_only_what_the_decode_engine_lacks(overlap: bool, page_size: int) -> None:
    """A second turn extends the first's prompt and output: D finds the first turn in its
    own cache, sets aside slots only for the rest, and only the rest goes."""
    pair = Pair.fake(overlap, page_size=page_size, chunk=7)
    first_msg = engine_request("t1", prompts(1, seed=3)[0] + [5] * 9, max_new=7)
    first = pair.submit(first_msg)
    pair.run()
    second_msg = engine_request("t2", first.tokens + [11, 12, 13], max_new=5)
    second = pair.submit(second_msg)
    pair.run()
    r = pair.reservations[-1]
    assert r.req is second
    cached = first.num_tokens - 1  # the last output token was never fed
    assert r.start == cached - cached % page_size > 0
    assert second.cached_tokens == r.start
    assert len(r.dest_slots) == len(second.input_ids) - r.start
    send = pair.p.worker.sent[-1]
    assert send.dest_rid == "t2" and len(send.slots) == len(r.dest_slots)
    assert send.key == kv_key(second.input_ids, r.start, None) == r.key
    assert pair.d.worker.received["t2"] == len(r.dest_slots)
    # One engine doing both, turn after turn.
    cfg = pair.d.sched.config
    sched = Scheduler(cfg)
    side = Side(sched, FakeKVWorker(cfg.num_slots), overlap)
    want = []
    for msg in (first_msg, second_msg):
        plain = mpb.EngineRequest()
        plain.CopyFrom(msg)
        plain.prefill_engine = ""
        want.append(request_from_proto(plain))
        sched.add_request(want[-1])
        while side.busy():
            side.step()
    same_outputs([first, second], want)
    pair.assert_idle()


def test_a_prompt_wholly_cached_on_the_decode_engine_sends_nothing() -> None:
    """D holds the whole prompt: it sets aside no slot, P sends nothing and only samples the
    first token, and D goes on from it."""
    pair = Pair.fake(page_size=1)
    prompt = prompts(1, seed=4)[0]
    first = pair.submit(engine_request("a", prompt + [1, 2], max_new=4))
    pair.run()
    again = pair.submit(engine_request("b", prompt, max_new=4))
    pair.run()
    r = pair.reservations[-1]
    assert r.start == len(prompt) and r.dest_slots == []
    assert [s.dest_rid for s in pair.p.worker.sent] == ["a"]
    assert not [b for b in pair.d.batches if any(e.rid == "b" for e in b.expects)]
    assert again.output_ids == reference_output(prompt, 4)
    assert first.output_ids == reference_output(prompt + [1, 2], 4)
    pair.assert_idle()


# ---- 3. a send that fails -----------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_a_failed_send_falls_back_to_prefilling_on_the_decode_engine(
    overlap: bool, page_size: int
) -> None:
    """A send that fails ends in a commit with its error: D frees the slots it set aside and
    prefills the prompt itself; the tokens are the same, nothing is held on either side."""
    pair = Pair.fake(overlap, page_size=page_size, chunk=7)
    msgs = [engine_request(f"r{i}", p, max_new=4 + i) for i, p in enumerate(prompts(6, 5, 8))]
    pair.p.worker.fail = {"r1": "connection refused", "r4": "connection refused"}
    reqs = [pair.submit(m) for m in msgs]
    pair.run()
    same_outputs(reqs, colocated(msgs, pair.d.sched.config, overlap))
    for req in reqs:
        assert req.transfer is not None
        failed = req.rid in pair.p.worker.fail
        assert req.transfer.fallback == ("connection refused" if failed else "")
        assert pair.d.fed[req.rid] == (len(req.input_ids) - req.cached_tokens if failed
                                       else len(req.input_ids) % page_size + 1)
    assert pair.p.sched.disagg.transfers_failed == 2
    assert pair.p.sched.disagg.transfers_ok == 4
    assert {c.rid for c in pair.commits if c.error} == {"r1", "r4"}
    pair.assert_idle()


def test_a_handoff_the_prefill_engine_refuses_falls_back() -> None:
    """P refuses a handoff it can never run (its pool is smaller): the service's error
    commit makes D prefill it."""
    d_cfg, p_cfg = config(num_slots=256), config(num_slots=32)
    pair = Pair(Side(Scheduler(d_cfg), FakeKVWorker(256), False),
                Side(Scheduler(p_cfg), FakeKVWorker(32), False))
    prompt = list(range(40))
    req = pair.submit(engine_request("big", prompt, max_new=3))
    pair.run()
    assert pair.refused == ["big"]
    assert req.transfer is not None and "exceeds the KV pool" in req.transfer.fallback
    assert req.output_ids == reference_output(prompt, 3)
    pair.assert_idle()


def test_a_handoff_for_other_tokens_is_refused() -> None:
    """The key names the prompt tokens after the decode engine's part: a handoff whose key
    does not match its tokens never becomes a request."""
    msg = engine_request("x", [1, 2, 3, 4], prefill="")
    payload = handoff_request(msg, DECODE, 1, [7, 8, 9], kv_key([1, 2, 3, 5], 1, None),
                              WORKERS, HOST)
    with pytest.raises(ValueError, match="names other tokens"):
        request_from_proto(mpb.EngineRequest.FromString(payload))
    payload = handoff_request(msg, DECODE, 1, [7, 8, 9], kv_key([1, 2, 3, 4], 1, None),
                              WORKERS, HOST)
    handed = request_from_proto(mpb.EngineRequest.FromString(payload))
    assert handed.handoff is not None and handed.transfer is None
    assert handed.rid == handoff_key("x", DECODE) and handed.handoff.rid == "x"
    assert handed.handoff.dest_slots == [7, 8, 9] and handed.handoff.start == 1
    # Slots that do not cover the rest of the prompt are refused by the scheduler.
    handed.handoff.dest_slots = [7, 8]
    with pytest.raises(ValueError, match="set aside 2 slots for 3 prompt tokens"):
        Scheduler(config()).add_request(handed)


# ---- 4. aborts ------------------------------------------------------------------------------


def abort_d(pair: Pair, rid: str) -> None:
    """The client of `rid` goes away (D's abort)."""
    assert pair.d.sched.abort(rid)


D_STAGES = ["reserving", "reserved", "prefilling", "sending", "committed", "decoding"]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("stage", D_STAGES)
def test_an_abort_on_the_decode_engine_at_any_stage_leaks_nothing(overlap: bool,
                                                                 stage: str) -> None:
    """The client goes away while D waits for slots, right after it set them aside, while P
    prefills, while the KV is on its way (held there until after the abort), once the KV is
    in but before D admits the request, or while D decodes. Once D has set slots aside, P
    is told to drop the request; every slot comes back on both sides and the other requests
    get their tokens."""
    pair = Pair.fake(overlap, page_size=4, chunk=7)
    ps = prompts(4, seed=6, shared=5)
    ps[0] += list(range(20))  # several chunks on P
    msgs = [engine_request(f"r{i}", p, max_new=8) for i, p in enumerate(ps)]
    victim = "r0"
    if stage == "sending":
        pair.p.worker.hold = {victim}
    reqs = [pair.submit(m) for m in msgs]
    d = pair.d.sched
    if stage == "reserving":
        assert reqs[0] in d.disagg.reserving
        abort_d(pair, victim)

    def right_after_reserving() -> None:
        if stage == "reserved" and victim in d.disagg.awaiting and reqs[0].finish is None:
            abort_d(pair, victim)

    def watch(pair: Pair) -> None:
        req = reqs[0]
        if req.finish is not None:
            return
        handed = pair.handed.get(victim)
        p = pair.p.sched
        if stage == "prefilling" and handed is not None and p.chunked is handed:
            abort_d(pair, victim)
        elif stage == "sending" and pair.p.worker.sending(victim):
            abort_d(pair, victim)
            assert handed is not None
            for _ in range(3):  # P keeps the slots read by the send, D's inbox closes
                pair.tick()
                assert handed.finish is not None and p.disagg.reading(handed)
                assert handed.rid in p.requests and handed.slots
            assert "expects no KV" in pair.d.worker.inbox.admit(victim, "", [], 0)
            pair.p.worker.hold.clear()
        elif (stage == "committed" and req in d.waiting and req.output_ids) or (
                stage == "decoding" and req in d.running and len(req.output_ids) >= 3):
            abort_d(pair, victim)

    pair.between = right_after_reserving
    pair.run(watch)
    victim_req = reqs[0]
    assert victim_req.finish is not None and victim_req.finish.kind is FinishKind.ABORT
    want = colocated(msgs, d.config, overlap)
    assert want[0].output_ids[: len(victim_req.output_ids)] == victim_req.output_ids
    same_outputs(reqs[1:], want[1:])
    told = stage in ("reserved", "prefilling", "sending")
    assert (victim in pair.cancelled) is told
    assert (victim in pair.handed) is (stage not in ("reserving", "reserved"))
    if stage == "sending":  # the late KV found D's inbox closed
        assert pair.p.sched.disagg.transfers_failed == 1
        assert "r0" not in pair.d.worker.received
    pair.assert_idle()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_an_abort_on_the_prefill_engine_keeps_the_slots_a_send_reads(
    overlap: bool, page_size: int
) -> None:
    """P drops a request while its worker sends the prompt's KV: the slots stay P's until
    the send's outcome is in, then go; D hears of it in a commit with the error and prefills
    the prompt itself."""
    pair = Pair.fake(overlap, page_size=page_size, chunk=7)
    msgs = [engine_request(f"r{i}", p, max_new=6) for i, p in enumerate(prompts(3, 7, 6))]
    victim = "r1"
    pair.p.worker.hold = {victim}
    reqs = [pair.submit(m) for m in msgs]
    p = pair.p.sched
    seen: list[int] = []

    def watch(pair: Pair) -> None:
        handed = pair.handed.get(victim)
        if handed is None or not pair.p.worker.sending(victim):
            return
        if handed.finish is None:
            assert p.abort(handed.rid)
            assert p.disagg.reading(handed) and handed.rid in p.requests
        own = len(handed.slots) - handed.cached_len
        seen.append(own)
        assert handed.slots and p.held_slots() >= own
        if len(seen) == 4:
            pair.p.worker.hold.clear()

    pair.run(watch)
    assert len(seen) == 4
    handed = pair.handed[victim]
    assert handed.finish is not None and handed.finish.kind is FinishKind.ABORT
    assert not handed.slots and handed.rid not in p.requests
    error = next(c.error for c in pair.commits if c.rid == victim)
    assert error == "aborted"
    assert reqs[1].transfer is not None and reqs[1].transfer.fallback == "aborted"
    same_outputs(reqs, colocated(msgs, pair.d.sched.config, overlap))
    pair.assert_idle()


# ---- 5. a prefill engine that answers too late ----------------------------------------------


class Clock:
    """monotonic() for the disaggregation module, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.mark.parametrize("late", ["kv", "commit"])
def test_an_overdue_transfer_falls_back_and_a_late_commit_is_ignored(
    monkeypatch: pytest.MonkeyPatch, late: str
) -> None:
    """The KV (held on its way) or P's commit (held by the network) comes after D's deadline:
    D prefills the prompt itself; the late KV finds D's inbox closed, the late commit is
    ignored, and the tokens are D's own."""
    clock = Clock()
    monkeypatch.setattr(disaggregation, "time", SimpleNamespace(monotonic=clock.monotonic))
    pair = Pair.fake(page_size=4, chunk=7, transfer_timeout=5.0)
    msg = engine_request("slow", prompts(1, seed=8)[0] + [3] * 10, max_new=6)
    req = pair.submit(msg)
    d = pair.d.sched
    if late == "kv":
        pair.p.worker.hold = {"slow"}
    else:
        pair.hold_commits = True
    pair.tick()
    assert req.transfer is not None and req.transfer.deadline == clock.now + 5.0
    assert d.disagg.expired(clock.now + 4.9) == []
    assert d.disagg.expired(clock.now + 5.1) == [req]
    for _ in range(40):  # P prefills; the KV or the commit stays on its way
        pair.tick()
    assert "slow" in d.disagg.awaiting and not req.output_ids
    assert (pair.p.worker.sending("slow") if late == "kv" else len(pair.held) == 1)
    clock.now += 5.1
    pair.tick()  # D notices at its next step and prefills the prompt itself
    assert "slow" not in d.disagg.awaiting
    assert req.transfer.fallback == "no KV from P within 5 s"
    assert "slow" in pair.cancelled
    pair.p.worker.hold.clear()
    pair.hold_commits = False
    pair.run()
    late_commit = next(c for c in pair.commits if c.rid == "slow")
    if late == "kv":  # P dropped it on D's word; its KV then found D's inbox closed
        assert late_commit.error == "aborted"
        assert pair.p.sched.disagg.transfers_failed == 1 and "slow" not in pair.d.worker.received
    else:  # the KV went and the first token with it: D has its own by then
        assert late_commit.error == "" and list(late_commit.output_ids) == req.output_ids[:1]
    assert req.output_ids == reference_output(msg.input_ids, 6)
    assert pair.d.fed["slow"] == len(msg.input_ids) - req.cached_tokens
    pair.assert_idle()


# ---- 6. a prefill engine that goes away ------------------------------------------------------


def test_losing_the_prefill_engine_falls_back_every_request_waiting_for_it() -> None:
    """P goes away with requests in every state: those D still had to set slots aside for
    and those whose KV it awaited are prefilled on D; the ones already in are unaffected, and
    so is a request whose KV comes from another prefill engine."""
    pair = Pair.fake(page_size=4, chunk=7)
    ps = prompts(6, seed=9, shared=4)
    ps[0] = ps[0][:6]  # its commit comes first
    ps[1] += list(range(30))  # still prefilling on P
    msgs = [engine_request(f"r{i}", p, max_new=5) for i, p in enumerate(ps)]
    other = engine_request("q", ps[5] + [1, 2], max_new=5, prefill="P2")
    pair.p.worker.hold = {"r2"}  # its KV stays on its way
    reqs = [pair.submit(m) for m in msgs[:4]]
    q = pair.submit(other)
    while not pair.commits:
        pair.tick()
    reqs += [pair.submit(m) for m in msgs[4:]]  # D has not set slots aside for these yet
    d = pair.d.sched
    waiting = {r.rid for r in [*d.disagg.reserving, *d.disagg.awaiting.values()]}
    assert {"r1", "r2", "r4", "r5", "q"} <= waiting and "r0" not in waiting
    awaited = {rid for rid in d.disagg.awaiting if rid != "q"}
    pair.prefill_alive = False
    d.transfers.lose_prefill_engine(PREFILL)
    assert set(d.disagg.awaiting) == {"q"} and not d.disagg.reserving
    assert {rid for rid, _ in d.disagg.take_cancelled()} == awaited
    for req in reqs:
        assert req.transfer is not None
        lost = req.rid in waiting
        assert req.transfer.fallback == ("prefill engine P went away" if lost else "")
    for _ in range(5):
        pair.tick()
    assert "q" in d.disagg.awaiting
    d.transfers.lose_prefill_engine("P2")
    assert q.transfer is not None and q.transfer.fallback == "prefill engine P2 went away"
    pair.run()
    same_outputs([*reqs, q], colocated([*msgs, other], d.config))
    pair.assert_idle()


# ---- 7. a request that ends with its first token ---------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("how", ["length", "eos", "stop_token"])
def test_a_request_ending_at_its_first_token_ends_on_the_decode_engine(
    overlap: bool, how: str
) -> None:
    """P's first token is also the last (max_new_tokens=1, the model's stop token, a stop
    token of the request): D finishes the request with P's token and reason, and never runs
    it."""
    prompt = prompts(1, seed=10)[0]
    first = reference_output(prompt, 1)[0]
    kw: dict[str, Any] = {}
    if how == "eos":
        kw["eos_token_ids"] = (first,)
    params: dict[str, Any] = {"stop_token_ids": [first]} if how == "stop_token" else {}
    pair = Pair.fake(overlap, page_size=4, **kw)
    msgs = [engine_request("one", prompt, max_new=1 if how == "length" else 8, **params),
            engine_request("two", prompt + [7, 7, 7], max_new=4)]
    reqs = [pair.submit(m) for m in msgs]
    pair.run()
    same_outputs(reqs, colocated(msgs, pair.d.sched.config, overlap))
    one = reqs[0]
    assert one.output_ids == [first]
    kind = FinishKind.LENGTH if how == "length" else FinishKind.STOP
    assert one.finish == FinishReason(kind, 1 if how == "length" else first)
    assert "one" not in pair.d.fed
    handed = pair.handed["one"]
    assert handed.finish == one.finish and handed.finish != HANDED_BACK
    pair.assert_idle()


# ---- everything at once ------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_aborts_failures_and_timeouts_leak_nothing(
    monkeypatch: pytest.MonkeyPatch, overlap: bool, seed: int
) -> None:
    """Requests arrive over time (some a later turn of an earlier one); clients go away on D,
    P drops requests, sends fail or dawdle, transfers time out. Every request still ends with
    one engine's tokens (a prefix of them if its client went away), and nothing is held."""
    rng = random.Random(seed)
    clock = Clock()
    monkeypatch.setattr(disaggregation, "time", SimpleNamespace(monotonic=clock.monotonic))
    pair = Pair.fake(overlap, delay=rng.randint(0, 2), page_size=rng.choice([1, 2, 4]),
                     chunk=rng.choice([5, 16, 64]), transfer_timeout=3.0)
    base = prompts(30, seed, shared=6)
    reqs: list[Req] = []
    d_aborted: set[str] = set()

    def submit(i: int) -> None:
        prompt = base[i]
        done = [r for r in reqs if r.finish is not None and r.rid not in d_aborted]
        if done and rng.random() < 0.3:  # a later turn
            prompt = rng.choice(done).tokens + prompt[:3]
        rid = f"r{i}"
        if rng.random() < 0.15:
            pair.p.worker.fail[rid] = "reset by peer"
        if rng.random() < 0.15:
            pair.p.worker.hold.add(rid)
        reqs.append(pair.submit(engine_request(rid, prompt, max_new=rng.randint(1, 12))))

    arrivals = list(range(len(base)))
    for _ in range(8):
        submit(arrivals.pop(0))

    def chaos(pair: Pair) -> None:
        if arrivals and pair.ticks % 2 == 0:
            submit(arrivals.pop(0))
        roll = rng.random()
        live = [r for r in reqs if r.finish is None]
        if roll < 0.06 and live:
            victim = rng.choice(live)
            assert pair.d.sched.abort(victim.rid)
            d_aborted.add(victim.rid)
        elif roll < 0.12:
            handed = [r for r in pair.handed.values() if r.finish is None]
            if handed:
                pair.p.sched.abort(rng.choice(handed).rid)
        elif roll < 0.2 and pair.p.worker.hold:
            pair.p.worker.hold.discard(rng.choice(sorted(pair.p.worker.hold)))
        elif roll < 0.25:
            clock.now += 1.0
        if not arrivals and not pair.d.busy():  # only transfers are left: let time pass
            clock.now += 1.0

    pair.run(chaos)
    for req in reqs:
        want = reference_output(req.input_ids, req.params.max_new_tokens)
        assert req.finish is not None
        if req.rid in d_aborted:
            assert req.finish.kind is FinishKind.ABORT
            assert want[: len(req.output_ids)] == req.output_ids
        else:
            assert req.output_ids == want, req.rid
            assert req.finish.kind is FinishKind.LENGTH
    pair.p.worker.hold.clear()
    pair.run()
    pair.assert_idle()


# ---- 8. the pieces ------------------------------------------------------------------------------


def test_kv_key_names_the_tokens_their_prefix_and_namespace() -> None:
    """Equal for equal arguments (no namespace is the empty one), different otherwise."""
    tokens = [5, 6, 7, 8]
    key = kv_key(tokens, 2, None)
    assert key == kv_key(list(tokens), 2, None) == kv_key(tokens, 2, "")
    assert len({key, kv_key(tokens, 1, None), kv_key([5, 6, 7, 9], 2, None),
                kv_key([4, 6, 7, 8], 2, None), kv_key(tokens, 2, "tenant")}) == 5


def test_the_inbox_takes_only_the_slots_it_expects_under_the_key_until_released() -> None:
    """Unknown or released requests, other tokens and other slots are refused."""
    inbox = KVInbox()
    key = kv_key([1, 2, 3, 4], 1, None)
    inbox.expect(KVExpect("a", [10, 11, 12], key))
    assert len(inbox) == 1
    assert "expects no KV for request 'b'" in inbox.admit("b", key, [10], 8)
    assert "KV for other tokens" in inbox.admit("a", kv_key([1, 2, 3, 5], 1, None), [10], 8)
    assert "slots outside" in inbox.admit("a", key, [12, 13], 16)
    assert inbox.admit("a", key, [10, 11], 16) == ""  # a piece at a time
    assert inbox.admit("a", key, [12], 8) == ""
    inbox.release("a")
    assert "released or never set aside" in inbox.admit("a", key, [10], 8)
    inbox.expect(KVExpect("c", [1], key))
    inbox.clear()
    assert len(inbox) == 0 and inbox.admit("c", key, [1], 8)


@pytest.mark.parametrize(("ours", "theirs"), [(1, 3), (3, 1), (2, 3), (3, 2), (6, 6), (1, 1)])
def test_head_overlaps_cover_every_head_once(ours: int, theirs: int) -> None:
    """Over 6 KV heads, the pieces every sending rank cuts its heads into cover each head
    exactly once, each within its sender's and its receiver's share."""
    total = 6
    covered: list[int] = []
    for rank in range(ours):
        for other, a, b in head_overlaps(total, ours, theirs, rank):
            mine, their = total // ours, total // theirs
            assert rank * mine <= a < b <= (rank + 1) * mine
            assert other * their <= a and b <= (other + 1) * their
            covered.extend(range(a, b))
    assert sorted(covered) == list(range(total))
    assert head_overlaps(6, 1, 3, 0) == [(0, 0, 2), (1, 2, 4), (2, 4, 6)]
    assert head_overlaps(6, 3, 1, 1) == [(0, 2, 4)]
    assert head_overlaps(6, 2, 3, 1) == [(1, 3, 4), (2, 4, 6)]


def test_a_porter_moves_heads_between_different_rank_counts() -> None:
    """One rank holding 4 heads sends to two ranks of 2: each receiving rank's pool ends up
    with its heads of the sent slots, in the slots set aside, and nothing else changes."""
    from radixmesh.engine.model.kv_pool import KVPool

    torch.manual_seed(0)
    sender = KVPool(2, 16, 4, 8, torch.float32)
    for t in [*sender.k, *sender.v]:
        t.copy_(torch.randn_like(t))
    receivers = [KVPool(2, 16, 2, 8, torch.float32) for _ in range(2)]
    out = KVPorter(sender, 4)
    ins = [KVPorter(pool, 4, rank, 2) for rank, pool in enumerate(receivers)]
    src, dest = [3, 5, 6], [9, 1, 14]
    data = out.read(src)
    assert data.shape == (4, 3, 4, 8)
    for rank, a, b in head_overlaps(4, 1, 2, 0):
        piece = data[:, :, a:b].contiguous()
        nbytes = piece.numel() * piece.element_size()
        assert ins[rank].check(3, a, b, 2, "float32", nbytes) == ""
        ins[rank].write(dest, a, piece)
    for rank, pool in enumerate(receivers):
        heads = slice(2 * rank, 2 * rank + 2)
        for layer in range(2):
            assert torch.equal(pool.k[layer][dest], sender.k[layer][src][:, heads])
            assert torch.equal(pool.v[layer][dest], sender.v[layer][src][:, heads])
            others = [s for s in range(16) if s not in dest]
            assert not pool.k[layer][others].any()
    assert "not this rank's" in ins[1].check(3, 0, 2, 2, "float32", 3 * 2 * 2 * 2 * 8 * 4)
    assert "does not fit" in ins[0].check(3, 0, 2, 3, "float32", 0)
    assert "does not fit" in ins[0].check(3, 0, 2, 2, "bfloat16", 0)
    assert "holds 8 bytes" in ins[0].check(3, 0, 2, 2, "float32", 8)


# ---- a real model on both sides ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny random Llama, loaded once."""
    path: Path = tmp_path_factory.mktemp("tiny") / "llama"
    return load_model(str(save_tiny_model(path)), progress=False)


def runner_worker(tiny: Any, page_size: int, dest_ranks: int = 1) -> RunnerKVWorker:
    """A float32 CPU runner of 256 slots."""
    runner = ModelRunner(tiny.config, tiny.weights, torch.float32, 256, page_size=page_size)
    return RunnerKVWorker(runner, dest_ranks=dest_ranks)


def runner_pair(tiny: Any, page_size: int, dest_ranks: int = 1) -> Pair:
    """Two engines with real runners."""
    cfg = config(num_slots=256, page_size=page_size, chunk=16, context_length=256)
    return Pair(Side(Scheduler(cfg), runner_worker(tiny, page_size, dest_ranks), False),
                Side(Scheduler(cfg), runner_worker(tiny, page_size), False))


def model_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts for the tiny model (ids below its stop token) with a common start."""
    rng = random.Random(seed)
    shared = [rng.randrange(250) for _ in range(6)]
    return [shared + [rng.randrange(250) for _ in range(rng.randint(3, 30))] for _ in range(n)]


@pytest.mark.parametrize(("page_size", "dest_ranks"), [(1, 1), (4, 2)])
def test_a_real_model_decodes_the_transferred_kv(tiny: Any, page_size: int,
                                                 dest_ranks: int) -> None:
    """Two tiny model runners: P's KV read with KVPorter and written into D's pool (head by
    head for two receiving ranks) gives D the tokens and logprobs of one runner doing both,
    a second turn included; KV written into the wrong slots changes the tokens."""
    ps = model_prompts(4, seed=page_size)
    msgs = [engine_request(f"m{i}", p, max_new=8, logprobs=i == 0) for i, p in enumerate(ps)]
    pair = runner_pair(tiny, page_size, dest_ranks)
    reqs = [pair.submit(m) for m in msgs]
    pair.run()
    turn2 = engine_request("turn2", reqs[1].tokens + [17, 18], max_new=6)
    reqs.append(pair.submit(turn2))
    pair.run()
    assert pair.reservations[-1].start > 0
    cfg = pair.d.sched.config
    want = colocated([*msgs, turn2], cfg, worker=runner_worker(tiny, page_size))
    same_outputs(reqs, want)
    got, ref = reqs[0], want[0]
    assert got.output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-4)
    assert len(got.input_logprobs) == len(ps[0])
    assert got.input_logprobs[1:] == pytest.approx(ref.input_logprobs[1:], abs=1e-4)
    assert [t for t, _ in got.output_top_logprobs[0]] == [t for t, _ in ref.output_top_logprobs[0]]
    for req in reqs:
        assert req.transfer is not None and not req.transfer.fallback
        assert pair.d.worker.received[req.rid] == len(req.input_ids) - req.cached_tokens
    pair.assert_idle()
    # The same requests with the KV written into the right slots in the wrong order.
    wrong = runner_pair(tiny, page_size, dest_ranks)
    assert isinstance(wrong.d.worker, RunnerKVWorker)
    wrong.d.worker.corrupt = True
    garbled = [wrong.submit(m) for m in msgs]
    wrong.run()
    assert any(g.output_ids != w.output_ids for g, w in zip(garbled, want, strict=False))


# ---- what else a transfer holds ----------------------------------------------------------------


@pytest.mark.parametrize("where", ["awaiting", "sending"])
def test_a_flush_waits_for_the_prefixes_a_transfer_holds(where: str) -> None:
    """A flush is refused while D awaits KV after a prefix of its own, or while P's worker
    sends a prompt's KV; it goes through once they are done."""
    pair = Pair.fake(page_size=1)
    prompt = prompts(1, seed=11)[0]
    if where == "awaiting":
        pair.submit(engine_request("a", prompt, max_new=3))
        pair.run()
        pair.hold_commits = True
        pair.submit(engine_request("b", prompt + [1, 2, 3], max_new=3))
        pair.tick()
        assert pair.reservations[-1].start > 0
        sched = pair.d.sched
    else:
        pair.p.worker.hold = {"a"}
        pair.submit(engine_request("a", prompt, max_new=3))
        while not pair.p.worker.sending("a"):
            pair.tick()
        pair.tick()  # the first token is in; the send is not
        handoff = pair.handed["a"].handoff
        assert handoff is not None and handoff.sampled
        sched = pair.p.sched
    assert sched.flush_cache() is False
    pair.hold_commits = False
    pair.p.worker.hold.clear()
    pair.run()
    assert pair.d.sched.flush_cache() and pair.p.sched.flush_cache()
    pair.assert_idle()


def test_a_full_decode_pool_cuts_no_request_short() -> None:
    """Three prompts of 20 tokens, 30 new tokens each, a decode pool of 64 slots: one engine
    doing both finishes every request, retracting as it must; so should the pair."""
    cfg = config(num_slots=64, chunk=64)
    pair = Pair(Side(Scheduler(cfg), FakeKVWorker(64), False),
                Side(Scheduler(config(chunk=64)), FakeKVWorker(1024), False))
    msgs = [engine_request(f"r{i}", [(7 * i + j) % 50 for j in range(20)], max_new=30)
            for i in range(3)]
    reqs = [pair.submit(m) for m in msgs]
    pair.run()
    pair.assert_idle()
    same_outputs(reqs, colocated(msgs, cfg))


def test_a_busy_decode_engine_does_not_get_stuck() -> None:
    """Requests arriving every few steps at a decode pool of 192 slots: the engine retracts
    under the load, and still finishes every request."""
    rng = random.Random(19)
    cfg = config(num_slots=192, chunk=8)
    pair = Pair(Side(Scheduler(cfg), FakeKVWorker(192), False),
                Side(Scheduler(config()), FakeKVWorker(1024), False))
    msgs = [engine_request(f"r{i}", p, max_new=rng.randint(5, 40))
            for i, p in enumerate(prompts(20, seed=19))]
    arrivals = list(msgs)
    reqs = [pair.submit(arrivals.pop(0)) for _ in range(3)]

    def arrive(pair: Pair) -> None:
        if arrivals and pair.ticks % 3 == 0:
            reqs.append(pair.submit(arrivals.pop(0)))

    while pair.busy() and pair.ticks < 1000:  # done in under 200 steps when it works
        pair.tick()
        arrive(pair)
    d = pair.d.sched
    assert not pair.busy(), (
        f"stuck: {len(d.disagg.awaiting)} awaiting KV, {d.cache.protected_size()} of "
        f"{d.config.num_slots} slots locked, {d.allocator.available()} free"
    )
    same_outputs(reqs, colocated(msgs, cfg))
    pair.assert_idle()
