"""A hybrid linear-attention model's radix cache without a model or sockets: the tree's
payload plug-in (a match cut back to the deepest snapshot, snapshots leaving leaf first with
their KV, locks protecting them, a snapshot saved this step matched from the next), and the
scheduler against a fake worker that keeps each row's "state" as the tokens it has fed and
checks that every request admitted from a snapshot starts from exactly the tokens its
cached prefix covers: random workloads with shared prefixes, follow-up turns, stop tokens
(an overlapped scheduler's decode past the finish), retractions and tiny snapshot pools;
every slot and snapshot back at the end."""

from __future__ import annotations

import random

import pytest
from fake_worker import FakeWorker, reference_output
from test_scheduler import make_req, run

from radixmesh.core.sampling_params import SamplingParams
from radixmesh.core.step import NewRequest, StateSave, StepBatch, StepResult
from radixmesh.engine.kv_allocator import KVAllocator
from radixmesh.engine.radix_cache import RadixCache
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler import Scheduler
from radixmesh.engine.scheduler_config import SchedulerConfig
from radixmesh.engine.state_snapshots import SnapshotHoldings, StateSnapshots
from radixmesh.engine.tree_node import TreeNode
from radixmesh.proto import worker_pb2 as wpb
from radixmesh.proto.convert import batch_from_proto, batch_to_proto

KEY = list(range(100, 120))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def tree(snapshots: int, page: int = 1) -> tuple[RadixCache, StateSnapshots, KVAllocator]:
    allocator = KVAllocator(64, page)
    payload = StateSnapshots(snapshots)
    return RadixCache(allocator, page, clock=Clock(), payload=payload), payload, allocator


def make_room(cache: RadixCache, payload: StateSnapshots) -> bool:
    """Whether a snapshot slot can be had, evicting for it as the scheduler does (the slot
    given back)."""
    holdings = SnapshotHoldings(cache.allocator, cache, cache.page_size, payload)
    slot = holdings.take_slot()
    if slot < 0:
        return False
    payload.give(slot)
    return True


def cache_with_snapshots(cache: RadixCache, payload: StateSnapshots, allocator: KVAllocator,
                         key: list[int], ends: list[int]) -> list[TreeNode]:
    """key cached, and a node ending at each of `ends` holding a snapshot; those nodes."""
    slots = allocator.alloc(len(key))
    assert slots is not None
    cache.insert(key, slots)
    nodes = []
    for end in ends:
        node = cache.match_prefix(key[:end], whole=True).node
        payload.attach(node, payload.take())
        nodes.append(node)
    cache.check_invariants()
    return nodes


# ---- the tree's payload -------------------------------------------------------------------


@pytest.mark.parametrize("page", [1, 2])
def test_a_match_is_cut_back_to_the_deepest_snapshot(page: int) -> None:
    cache, payload, allocator = tree(4, page)
    at_4, at_10 = cache_with_snapshots(cache, payload, allocator, KEY, [4, 10])
    whole = cache.match_prefix(KEY[:16], whole=True)
    assert len(whole.slots) == 16
    root = cache.match_prefix([]).node
    for length, node in ((3, root), (4, at_4), (9, at_4), (16, at_10), (20, at_10)):
        match = cache.match_prefix(KEY[:length])
        assert match.node is node
        assert match.slots == whole.slots[: node.depth + len(node.key)]
    # A match splits the edge below 10 at 16: the snapshot stays at 10's end.
    assert payload.slot_of(at_10) >= 0 and at_10.depth + len(at_10.key) == 10
    cache.check_invariants()


def test_a_snapshot_the_step_being_built_saves_is_matched_from_the_next() -> None:
    cache, payload, allocator = tree(4)
    (at_4,) = cache_with_snapshots(cache, payload, allocator, KEY, [4])
    at_12 = cache.match_prefix(KEY[:12], whole=True).node
    payload.attach(at_12, payload.take(), fresh=True)
    assert cache.match_prefix(KEY).node is at_4
    payload.step_built()
    assert cache.match_prefix(KEY).node is at_12


def test_snapshots_leave_leaf_first_with_their_kv() -> None:
    """Out of slots: the least recently used leaf goes, KV and snapshot; a leaf without a
    snapshot goes too on the way (its KV is no use without one below it); the snapshot
    above stays until its node is a leaf itself."""
    cache, payload, allocator = tree(3)
    at_4, at_10 = cache_with_snapshots(cache, payload, allocator, KEY, [4, 10])
    other = [7, 7, 7, 7, 7, 7]
    (at_other,) = cache_with_snapshots(cache, payload, allocator, other, [6])
    assert not payload.has_room()
    free = allocator.available()
    assert make_room(cache, payload)
    # KEY's tail past 10 (no snapshot) and its node from 4 to 10 went: 16 tokens' KV.
    assert allocator.available() == free + 16
    assert payload.slot_of(at_10) < 0 and at_10.parent is None
    assert payload.slot_of(at_4) >= 0 and payload.slot_of(at_other) >= 0
    cache.check_invariants()
    payload.attach(cache.match_prefix(other[:2], whole=True).node, payload.take())
    assert make_room(cache, payload)
    assert payload.slot_of(at_4) < 0 and at_4.parent is None  # older than `other`'s
    cache.check_invariants()
    # KV eviction takes a node's snapshot with it.
    cache.evict(64)
    assert (payload.free, payload.cached, cache.total_size()) == (3, 0, 0)
    cache.check_invariants()


def test_a_lock_protects_the_snapshots_above_it() -> None:
    cache, payload, allocator = tree(2)
    at_4, at_10 = cache_with_snapshots(cache, payload, allocator, KEY, [4, 10])
    cache.lock(at_10)
    assert not make_room(cache, payload)
    assert payload.cached == 2 and cache.total_size() == 10  # the tail past 10 went
    cache.unlock(at_10)
    assert make_room(cache, payload)
    assert payload.slot_of(at_10) < 0 and payload.slot_of(at_4) >= 0
    cache.lock(at_4)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.unlock(at_4)
    cache.reset()
    assert (payload.free, payload.cached) == (2, 0)


# ---- the scheduler against a fake worker that keeps states ----------------------------------


class StateWorker(FakeWorker):
    """FakeWorker whose rows also keep a "state": the tokens they fed, in order. Snapshot
    slots keep copies; a request admitted from one must find exactly its prefix there."""

    def __init__(self, num_slots: int, snapshots: int) -> None:
        super().__init__(num_slots)
        self.saved: list[list[int] | None] = [None] * snapshots
        self.restored = 0  # prefix tokens requests started from

    def forward(self, batch: StepBatch) -> StepResult:
        for save in batch.saves:
            if save.after == 0:
                self.saved[save.slot] = list(self.reqs[self.rows[save.row]][0])
        for new in batch.new_requests:
            if new.prefix_ids:
                assert new.snapshot >= 0, f"{new.rid}: a cached prefix without a snapshot"
                assert self.saved[new.snapshot] == new.prefix_ids, (
                    f"{new.rid}: snapshot {new.snapshot} holds the state after "
                    f"{self.saved[new.snapshot]}, not after its prefix {new.prefix_ids}")
                self.restored += len(new.prefix_ids)
            else:
                assert new.snapshot < 0
        # What each row had fed as the step starts (after its releases and admissions).
        before = {rid: len(ids) for rid, (ids, _, _) in self.reqs.items()
                  if rid not in batch.release}
        before.update({new.rid: len(new.prefix_ids) for new in batch.new_requests})
        result = super().forward(batch)
        for save in batch.saves:
            if save.after:
                rid = self.rows[save.row]
                ids = self.reqs[rid][0]
                assert before[rid] + save.after <= len(ids), f"{rid}: a save past its tokens"
                self.saved[save.slot] = ids[: before[rid] + save.after]
        return result


def hybrid(num_slots: int, snapshots: int, page: int, chunk: int, running: int = 8
           ) -> tuple[Scheduler, StateWorker]:
    cfg = SchedulerConfig(num_slots=num_slots, page_size=page, chunked_prefill_size=chunk,
                          max_running_requests=running, hybrid=True, state_snapshots=snapshots,
                          decode_reserve_ratio=0.0)
    return Scheduler(cfg), StateWorker(num_slots, snapshots)


def returned(sched: Scheduler) -> None:
    """Everything back once the cache is flushed."""
    assert sched.flush_cache()
    stats = sched.stats()
    assert stats["free_slots"] == stats["num_slots"] and stats["cached_tokens"] == 0
    assert stats["free_snapshots"] == stats["num_snapshots"]
    assert isinstance(sched.kv, SnapshotHoldings) and not sched.kv.rolling
    sched.check_invariants()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page", [1, 4])
def test_a_follow_up_starts_where_the_first_request_fed_to(overlap: bool, page: int) -> None:
    """A first request ended by its length (its last token never fed) or by a stop token
    (fed too when an overlapped scheduler had scheduled its decode already); its follow-up
    starts after what was fed, page-aligned, from the snapshot taken there."""
    for stop in (False, True):
        sched, worker = hybrid(1024, 8, page, 1024)
        prompt = list(range(30))
        ref = reference_output(prompt, 6)
        stop_ids = [ref[3]] if stop and ref[3] not in ref[:3] else []
        first = make_req("a", prompt, max_new=6)
        first.params.stop_token_ids.extend(stop_ids)
        sched.add_request(first)
        run(sched, worker, overlap)
        assert first.output_ids == reference_output(prompt, 6, tuple(stop_ids))
        follow = make_req("b", first.tokens + [1, 2, 3], max_new=4)
        sched.add_request(follow)
        run(sched, worker, overlap)
        fed = first.num_tokens - (0 if stop_ids and overlap else 1)
        assert follow.cached_tokens == fed - fed % page
        assert follow.output_ids == reference_output(follow.input_ids, 4)
        assert worker.restored == follow.cached_tokens
        returned(sched)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("chunk", [7, 1024])
@pytest.mark.parametrize("snapshots", [3, 32])
def test_random_workloads_restore_exact_states(overlap: bool, page: int, chunk: int,
                                               snapshots: int) -> None:
    """Shared system prompts, follow-up turns, stop tokens and a pool small enough to
    retract: every output is what the request alone gives, every admission from a snapshot
    starts from exactly its prefix, some do, and everything comes back."""
    rng = random.Random(page * 1000 + chunk + snapshots + overlap)
    sched, worker = hybrid(160, snapshots, page, chunk, running=8)
    systems = [[rng.randrange(50) for _ in range(rng.randint(8, 30))] for _ in range(3)]
    done: list[Req] = []
    cached = 0
    for wave in range(4):
        reqs = []
        for i in range(8):
            if done and rng.random() < 0.4:
                prompt = rng.choice(done).tokens + [rng.randrange(50) for _ in range(3)]
            else:
                prompt = rng.choice(systems) + [rng.randrange(50) for _ in range(rng.randint(1, 9))]
            req = make_req(f"w{wave}-{i}", prompt[:120], max_new=rng.randint(1, 32))
            if rng.random() < 0.3:
                alone = reference_output(req.input_ids, req.params.max_new_tokens)
                req.params.stop_token_ids.append(rng.choice(alone))
            reqs.append(req)
            sched.add_request(req)
        run(sched, worker, overlap)
        for req in reqs:
            stops = tuple(req.params.stop_token_ids)
            assert req.output_ids == reference_output(req.input_ids, req.params.max_new_tokens,
                                                      stops)
            cached += req.cached_tokens
        done.extend(reqs)
    assert cached > 0 and worker.restored >= cached and sched.num_retractions > 0
    returned(sched)


def test_saves_and_snapshots_travel_the_wire() -> None:
    """A step's StateSaves and a new request's snapshot slot (0 included; -1: none) through
    worker.proto and back."""
    params = SamplingParams(temperature=0)
    batch = StepBatch(
        3,
        new_requests=[NewRequest("a", 0, [1, 2], [5, 6], 2, params, 0, snapshot=0),
                      NewRequest("b", 1, [], [], 3, params, 0)],
        saves=[StateSave(0, 0, 4), StateSave(1, 3, 0)],
    )
    wire = wpb.StepBatch.FromString(batch_to_proto(batch).SerializeToString())
    assert wire.new_requests[0].HasField("snapshot")
    assert not wire.new_requests[1].HasField("snapshot")
    back = batch_from_proto(wire)
    assert [n.snapshot for n in back.new_requests] == [0, -1]
    assert back.saves == batch.saves
